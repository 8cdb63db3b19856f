"""Chain the action log: each row's hash covers the row and the hash before it; the
background verification checks that chain too.

The rows written before this are chained here in the order they were recorded (by
id), with the append-only trigger switched off for the one UPDATE that does it.
"""

import datetime as dt

from django.db import migrations, models

from ledger.chain import GENESIS_HASH, event_hash


def chain_recorded_actions(apps, schema_editor):
    AdminAction = apps.get_model("ledger", "AdminAction")
    prev = GENESIS_HASH
    for row in AdminAction.objects.order_by("id"):
        body = {
            "actor": row.actor,
            "action": row.action,
            "target": row.target,
            "reason": row.reason,
            "created_at": row.created_at.astimezone(dt.UTC).isoformat(),
        }
        row.prev_hash, row.hash = prev, event_hash(prev, body)
        row.save(update_fields=["prev_hash", "hash"])
        prev = row.hash


class Migration(migrations.Migration):
    dependencies = [
        ("ledger", "0028_verification_pass"),
    ]

    operations = [
        migrations.AddField(
            model_name="adminaction",
            name="prev_hash",
            field=models.CharField(default="", max_length=64),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="adminaction",
            name="hash",
            field=models.CharField(default="", max_length=64),
            preserve_default=False,
        ),
        migrations.RunSQL(
            "ALTER TABLE ledger_adminaction DISABLE TRIGGER ledger_adminaction_append_only",
            migrations.RunSQL.noop,
        ),
        migrations.RunPython(chain_recorded_actions, migrations.RunPython.noop),
        migrations.RunSQL(
            "ALTER TABLE ledger_adminaction ENABLE TRIGGER ledger_adminaction_append_only",
            migrations.RunSQL.noop,
        ),
        migrations.AddField(
            model_name="verificationpass",
            name="until_admin_action",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="verificationpass",
            name="after_admin_action",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="verificationpass",
            name="after_admin_action_hash",
            field=models.CharField(default=GENESIS_HASH, max_length=64),
        ),
        migrations.AddField(
            model_name="verificationpass",
            name="admin_actions",
            field=models.PositiveBigIntegerField(default=0),
        ),
        migrations.AddConstraint(
            model_name="adminaction",
            constraint=models.UniqueConstraint(
                fields=("prev_hash",), name="admin_action_one_successor"
            ),
        ),
    ]
