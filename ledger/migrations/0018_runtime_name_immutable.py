"""A runtime's name never changes, inside PostgreSQL itself.

Every event a runtime records names it as actor (`runtime:<name>`), and web processes
remember the name with the runtime's tokens (ledger/api/authentication.py). A rename
would orphan the one and leave the other writing the old name. The admin shows the
name read-only; this trigger also refuses it to a psql session or a bug.
"""

from django.db import migrations

FUNCTION = """
CREATE FUNCTION ledger_refuse_runtime_rename() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a runtime''s name is immutable: % cannot become %', OLD.name, NEW.name
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
"""

TRIGGER = """
CREATE TRIGGER ledger_runtime_name_immutable BEFORE UPDATE OF name ON ledger_runtime
    FOR EACH ROW WHEN (OLD.name IS DISTINCT FROM NEW.name)
    EXECUTE FUNCTION ledger_refuse_runtime_rename();
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0017_assert_token_active")]

    operations = [
        migrations.RunSQL(FUNCTION, "DROP FUNCTION ledger_refuse_runtime_rename();"),
        migrations.RunSQL(TRIGGER, "DROP TRIGGER ledger_runtime_name_immutable ON ledger_runtime;"),
    ]
