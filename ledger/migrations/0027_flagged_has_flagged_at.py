from django.contrib.postgres.operations import AddConstraintNotValid, ValidateConstraint
from django.db import migrations, models


class Migration(migrations.Migration):
    # Added NOT VALID, then validated: the check of the rows already there does not hold
    # a lock that stops runtimes writing. 0021 gave every flagged invocation its time.
    atomic = False

    dependencies = [
        ("ledger", "0026_event_shared_reference_time"),
    ]

    operations = [
        AddConstraintNotValid(
            model_name="invocation",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(
                        (
                            "status__in",
                            [
                                "escalated",
                                "reconciliation_required",
                                "reconciling",
                                "resolution_proposed",
                            ],
                        ),
                        _negated=True,
                    ),
                    ("flagged_at__isnull", False),
                    _connector="OR",
                ),
                name="invocation_flagged_has_flagged_at",
            ),
        ),
        ValidateConstraint(model_name="invocation", name="invocation_flagged_has_flagged_at"),
    ]
