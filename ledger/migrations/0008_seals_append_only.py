"""Seals and the global event order are append-only too (see 0002)."""

from django.db import migrations

TRIGGER = """
CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0007_seals")]

    operations = [
        migrations.RunSQL(
            TRIGGER.format(table=table), f"DROP TRIGGER {table}_append_only ON {table};"
        )
        for table in ("ledger_seal", "ledger_sealedevent")
    ]
