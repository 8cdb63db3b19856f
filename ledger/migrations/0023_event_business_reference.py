from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.models.fields.json import KeyTransform


class Migration(migrations.Migration):
    # Built concurrently: runtimes keep appending events while it builds.
    atomic = False

    dependencies = [
        ("ledger", "0022_probe_config_checked"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="event",
            index=models.Index(
                KeyTransform("business_reference", "data"),
                condition=models.Q(("data__business_reference__gt", "")),
                name="event_business_reference",
            ),
        ),
    ]
