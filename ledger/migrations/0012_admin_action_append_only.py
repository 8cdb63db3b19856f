"""Administrators' actions are append-only too (see 0002)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("ledger", "0011_admin_action")]

    operations = [
        migrations.RunSQL(
            "CREATE TRIGGER ledger_adminaction_append_only BEFORE UPDATE OR DELETE "
            "ON ledger_adminaction FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();",
            "DROP TRIGGER ledger_adminaction_append_only ON ledger_adminaction;",
        )
    ]
