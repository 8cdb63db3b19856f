"""The probe job last sent for each flagged invocation (ProbeDispatch)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0027_flagged_has_flagged_at"),
        ("reconciliation", "0001_roles"),
    ]

    operations = [
        migrations.CreateModel(
            name="ProbeDispatch",
            fields=[
                (
                    "invocation",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="probe_dispatch",
                        serialize=False,
                        to="ledger.invocation",
                    ),
                ),
                ("sent_at", models.DateTimeField()),
                ("event_count", models.PositiveIntegerField()),
            ],
        ),
    ]
