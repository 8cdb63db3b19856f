"""A capability's declarations are append-only too (see 0002): each import is kept as
it was, with who made it."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("ledger", "0029_admin_action_chain")]

    operations = [
        migrations.RunSQL(
            "CREATE TRIGGER ledger_capabilitydeclaration_append_only BEFORE UPDATE OR DELETE "
            "ON ledger_capabilitydeclaration FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();",
            "DROP TRIGGER ledger_capabilitydeclaration_append_only "
            "ON ledger_capabilitydeclaration;",
        )
    ]
