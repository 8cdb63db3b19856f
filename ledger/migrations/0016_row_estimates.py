"""`ledger_rows(jsonb)` and `ledger_keys(text[])`: set sources the planner counts as one row.

The evidence statements (ledger/store.py) are prepared once per connection and run
with a generic plan. PostgreSQL guesses that `jsonb_array_elements` returns 100 rows
and that `= ANY($n)` matches 10, so on a table of a few thousand rows, or on one it
has no statistics for yet, it planned a hash join over a sequential scan of
ledger_invocation: the plan stayed with the connection while the table grew, and an
outcome's projection update cost PostgreSQL a millisecond per 3,000 invocations.

Requests name one invocation, or a batch's worth: declaring these sources as one
row makes an index lookup per row the cheapest plan at every table size. A function
declared STRICT is not inlined into the query, so the planner keeps its ROWS; the
call costs a few microseconds.
"""

from django.db import migrations

FUNCTIONS = """
CREATE FUNCTION ledger_rows(jsonb) RETURNS SETOF jsonb
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE ROWS 1
AS 'SELECT jsonb_array_elements($1)';

CREATE FUNCTION ledger_keys(text[]) RETURNS SETOF text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE ROWS 1
AS 'SELECT unnest($1)';
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0015_shared_cache")]

    operations = [
        migrations.RunSQL(
            FUNCTIONS, "DROP FUNCTION ledger_rows(jsonb); DROP FUNCTION ledger_keys(text[]);"
        ),
    ]
