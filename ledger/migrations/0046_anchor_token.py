"""An anchor's RFC 3161 timestamp token, when a time-stamping authority took it.

Adding a nullable column without a default rewrites nothing: ledger_anchor is not held
for longer than the catalog change."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0045_anchors"),
    ]

    operations = [
        migrations.AddField(
            model_name="anchor",
            name="token",
            field=models.BinaryField(editable=False, null=True),
        ),
    ]
