"""`ledger_assert_written(ok)`: raises SQLSTATE LD001 when ok is false.

The evidence write (ledger/store.py) is one statement whose last step checks that
every compare-and-set and insert happened; raising there rolls the whole statement
back, so a request that lost a race writes nothing and retries.
"""

from django.db import migrations

FUNCTION = """
CREATE FUNCTION ledger_assert_written(ok boolean) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT ok THEN
        RAISE EXCEPTION 'a concurrent request changed this invocation first'
            USING ERRCODE = 'LD001';
    END IF;
    RETURN true;
END;
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0002_append_only")]

    operations = [
        migrations.RunSQL(FUNCTION, "DROP FUNCTION ledger_assert_written(boolean);"),
    ]
