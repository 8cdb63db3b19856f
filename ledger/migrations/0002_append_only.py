"""Evidence is append-only inside PostgreSQL itself.

UPDATE and DELETE on events, attempts and outcomes raise, whoever asks: the ORM, a
psql session of the application's role, a bug. TRUNCATE is left alone so test
databases can be flushed; production roles should not hold TRUNCATE (README).
"""

from django.db import migrations

APPEND_ONLY_TABLES = ["ledger_event", "ledger_attempt", "ledger_outcome"]

FUNCTION = """
CREATE FUNCTION ledger_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger evidence is append-only: % on % refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
"""

TRIGGER = """
CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table}
    FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0001_initial")]

    operations = [
        migrations.RunSQL(FUNCTION, "DROP FUNCTION ledger_refuse_change();"),
        *[
            migrations.RunSQL(
                TRIGGER.format(table=table), f"DROP TRIGGER {table}_append_only ON {table};"
            )
            for table in APPEND_ONLY_TABLES
        ],
    ]
