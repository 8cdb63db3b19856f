"""The action log keeps the capability registry's history: each declaration
registered (its digest and the fields derived from it) and each change of a
capability's ledger settings (with the settings it leaves), so verification can check
every capability row against it.

What was registered and set before this is appended here, once, in the order the
declarations were recorded, marked as recorded by this migration: from here on the
log anchors it.
"""

import datetime as dt

from django.db import migrations, models
from django.utils import timezone

from ledger.chain import GENESIS_HASH, digest, event_hash

ACTOR = "migration:0031"
DECLARED_FIELDS = (
    "enabled",
    "readonly",
    "idempotent",
    "risk_level",
    "subject_required",
    "audit_sensitive",
    "timeout_ms",
)
DEFAULT_SETTINGS: dict[str, object] = {
    "idempotency_verified": False,
    "max_attempts": None,
    "grace_ms": None,
    "redact_paths": [],
    "probe": {},
}


def record_the_registry(apps, schema_editor):
    AdminAction = apps.get_model("ledger", "AdminAction")
    Capability = apps.get_model("ledger", "Capability")
    schema_editor.execute("SELECT pg_advisory_xact_lock(hashtext('ledger.admin_action'))")
    prev = AdminAction.objects.order_by("-id").values_list("hash", flat=True).first()
    prev = prev or GENESIS_HASH
    now = timezone.now()

    def append(actor, action, target, reason, details):
        nonlocal prev
        body = {
            "actor": actor,
            "action": action,
            "target": target,
            "reason": reason,
            "created_at": now.astimezone(dt.UTC).isoformat(),
            "details": details,
        }
        row = AdminAction.objects.create(
            actor=actor,
            action=action,
            target=target,
            reason=reason,
            details=details,
            created_at=now,
            prev_hash=prev,
            hash=event_hash(prev, body),
        )
        prev = row.hash

    for capability in Capability.objects.order_by("id"):
        declarations = list(capability.declarations.order_by("version"))
        for declaration in declarations:
            details = {
                "version": declaration.version,
                "source": declaration.source,
                "digest": digest(declaration.declaration),
            }
            if declaration.version == capability.version:
                details["fields"] = {name: getattr(capability, name) for name in DECLARED_FIELDS}
            append(
                declaration.actor,
                "declaration_registered",
                capability.scope,
                f"recorded by migration 0031 for a declaration registered at "
                f"{declaration.created_at.astimezone(dt.UTC).isoformat()}",
                details,
            )
        settings = {name: getattr(capability, name) for name in DEFAULT_SETTINGS}
        changed = {
            name: {"from": DEFAULT_SETTINGS[name], "to": value}
            for name, value in settings.items()
            if value != DEFAULT_SETTINGS[name]
        }
        if changed:
            append(
                ACTOR,
                "capability_settings_changed",
                capability.scope,
                "the settings in force when the action log began to keep them",
                {"changed": changed, "settings": settings},
            )


class Migration(migrations.Migration):
    dependencies = [("ledger", "0030_capability_declaration_append_only")]

    operations = [
        migrations.AddField(
            model_name="adminaction",
            name="details",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.AddField(
            model_name="verificationpass",
            name="capabilities",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.RunPython(record_the_registry, migrations.RunPython.noop),
    ]
