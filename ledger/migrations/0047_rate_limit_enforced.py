"""A capability's rate limit enforced at admission, where an admin says so.

The column's default is the database's too (a constant: adding it rewrites nothing);
the admissions counted under an enforced limit go to a table of their own, new and so
empty when its index is built."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0046_anchor_token"),
    ]

    operations = [
        migrations.AddField(
            model_name="capability",
            name="rate_limit_enforced",
            field=models.BooleanField(
                db_default=False,
                default=False,
                help_text="Refuse an attempt beyond the declared execution.rate_limit (429, nothing recorded), instead of admitting it and flagging its invocation rate_limit_exceeded.",
            ),
        ),
        migrations.CreateModel(
            name="RateAdmission",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("scope", models.CharField(max_length=160)),
                ("number", models.BigIntegerField()),
                ("admitted_at", models.DateTimeField()),
                ("invocation_id", models.CharField(max_length=128)),
                ("attempt_id", models.CharField(max_length=128)),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("scope", "number"), name="rate_admission_number"
                    )
                ],
            },
        ),
    ]
