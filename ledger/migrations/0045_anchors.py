"""Anchors: the hashes sent outside the database, append-only like the seals (0008)."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0044_claim_reopened_time"),
    ]

    operations = [
        migrations.CreateModel(
            name="Anchor",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("seal_hash", models.CharField(blank=True, max_length=64)),
                ("action_hash", models.CharField(blank=True, max_length=64)),
                ("url", models.CharField(max_length=500)),
                ("sent_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("status", models.PositiveSmallIntegerField()),
                ("receipt", models.TextField(blank=True)),
                ("seal", models.ForeignKey(null=True, on_delete=django.db.models.deletion.PROTECT, related_name="+", to="ledger.seal")),
                ("action", models.ForeignKey(null=True, on_delete=django.db.models.deletion.PROTECT, related_name="+", to="ledger.adminaction")),
            ],
        ),
        migrations.RunSQL(
            "CREATE TRIGGER ledger_anchor_append_only BEFORE UPDATE OR DELETE ON ledger_anchor "
            "FOR EACH ROW EXECUTE FUNCTION ledger_refuse_change();",
            "DROP TRIGGER ledger_anchor_append_only ON ledger_anchor;",
        ),
    ]  # fmt: skip
