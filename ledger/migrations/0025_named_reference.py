import django.db.models.deletion
from django.db import migrations, models

# Every reference the events name already, with the invocation whose event named it first.
BACKFILL = """
INSERT INTO ledger_namedreference (reference, first_named_by_id)
SELECT DISTINCT ON (data ->> 'business_reference') data ->> 'business_reference', invocation_id
FROM ledger_event
WHERE (data -> 'business_reference') > '""'::jsonb
ORDER BY data ->> 'business_reference', id
"""

# Who named a reference first is a fact like the events it comes from (see 0002).
APPEND_ONLY = """
CREATE TRIGGER ledger_namedreference_append_only BEFORE UPDATE OR DELETE
    ON ledger_namedreference FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0024_event_business_reference_statistics"),
    ]

    operations = [
        migrations.CreateModel(
            name="NamedReference",
            fields=[
                ("reference", models.TextField(primary_key=True, serialize=False)),
                (
                    "first_named_by",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="+",
                        to="ledger.invocation",
                    ),
                ),
            ],
        ),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.RunSQL(
            APPEND_ONLY, "DROP TRIGGER ledger_namedreference_append_only ON ledger_namedreference;"
        ),
    ]
