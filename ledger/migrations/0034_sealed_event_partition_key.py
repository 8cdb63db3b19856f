"""Each sealed event records its event's partition key (migration 0033).

Joined by id alone, a sealed event's event is looked for in every month partition;
joined by id and `invocation_created_at`, PostgreSQL prunes the others as it reads,
so a seal's check and the rate watch read one partition per event however many
months the ledger holds (ledger.models.SealedEventQuerySet.with_events).
"""

from django.db import migrations, models

FILL = """
ALTER TABLE ledger_sealedevent DISABLE TRIGGER ledger_sealedevent_append_only;
UPDATE ledger_sealedevent s SET event_invocation_created_at = e.invocation_created_at
  FROM ledger_event e WHERE e.id = s.event_id;
ALTER TABLE ledger_sealedevent ENABLE TRIGGER ledger_sealedevent_append_only;
ALTER TABLE ledger_sealedevent ALTER COLUMN event_invocation_created_at SET NOT NULL;
"""


class Migration(migrations.Migration):
    dependencies = [("ledger", "0033_partition_events_by_month")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    "ALTER TABLE ledger_sealedevent ADD COLUMN event_invocation_created_at "
                    "timestamptz",
                    "ALTER TABLE ledger_sealedevent DROP COLUMN event_invocation_created_at",
                ),
                migrations.RunSQL(FILL, migrations.RunSQL.noop),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="sealedevent",
                    name="event_invocation_created_at",
                    field=models.DateTimeField(editable=False),
                ),
            ],
        )
    ]
