"""`ledger_assert_token_active(ok)`: raises SQLSTATE LD002 when ok is false.

A web process remembers the runtime tokens it has read (ledger/api/authentication.py)
and, instead of reading one again before each request, has the request's evidence
statement check that it is still unrevoked. The write checks it first: raising there
rolls the whole statement back, so a revoked token writes nothing, and its distinct
code lets the request answer 401 rather than retry as after a lost race.
"""

from django.db import migrations

FUNCTION = """
CREATE FUNCTION ledger_assert_token_active(ok boolean) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT ok THEN
        RAISE EXCEPTION 'the runtime token was revoked' USING ERRCODE = 'LD002';
    END IF;
    RETURN true;
END;
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0016_row_estimates")]

    operations = [
        migrations.RunSQL(FUNCTION, "DROP FUNCTION ledger_assert_token_active(boolean);"),
    ]
