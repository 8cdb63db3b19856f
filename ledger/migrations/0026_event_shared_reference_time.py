from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Built concurrently: runtimes keep appending events while it builds.
    atomic = False

    dependencies = [
        ("ledger", "0025_named_reference"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="event",
            index=models.Index(
                condition=models.Q(
                    ("data__has_key", "also_named_by"),
                    ("data__has_key", "also_named_elsewhere"),
                    _connector="OR",
                ),
                fields=["created_at"],
                name="event_shared_reference_time",
            ),
        ),
    ]
