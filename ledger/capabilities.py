"""The capability registry: ACC declarations in, versioned capabilities out."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.db import transaction

from ledger import acc
from ledger.models import Capability, CapabilityDeclaration


class Registered(StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


@dataclass(frozen=True)
class Registration:
    capability: Capability
    outcome: Registered


def _apply(capability: Capability, declaration: acc.Declaration) -> None:
    """Derive the ACC fields; the ledger's own settings (idempotency_verified,
    max attempts, grace, redaction, probe) are the administrator's and stay."""
    capability.declaration = declaration.raw
    capability.enabled = declaration.enabled
    capability.readonly = declaration.readonly
    capability.idempotent = declaration.idempotent
    capability.risk_level = declaration.risk
    capability.subject_required = declaration.subject_required
    capability.audit_sensitive = declaration.audit_sensitive
    capability.timeout_ms = declaration.timeout_ms


@transaction.atomic
def capability_register(*, declaration: acc.Declaration, source: str, actor: str) -> Registration:
    """Register a declaration; a changed one becomes a new version, the old one kept."""
    capability = Capability.objects.select_for_update().filter(scope=declaration.scope).first()
    if capability is not None and capability.declaration == declaration.raw:
        return Registration(capability, Registered.UNCHANGED)
    outcome = Registered.CREATED if capability is None else Registered.UPDATED
    capability = capability or Capability(scope=declaration.scope)
    _apply(capability, declaration)
    capability.version += 1
    capability.save()
    CapabilityDeclaration.objects.create(
        capability=capability,
        version=capability.version,
        declaration=declaration.raw,
        source=source,
        actor=actor,
    )
    return Registration(capability, outcome)


@dataclass(frozen=True)
class ImportReport:
    registered: list[tuple[acc.Found, Registered]]
    skipped: list[acc.Skipped]


@transaction.atomic
def capabilities_import(
    *, document: dict[str, Any], source: str, actor: str, dry_run: bool = False
) -> ImportReport:
    """Register every valid declaration of an OpenAPI document; report the others.

    With dry_run nothing is written, but the report says what would have been.
    """
    registered, skipped = [], []
    for entry in acc.declarations_in(document):
        if isinstance(entry, acc.Skipped):
            skipped.append(entry)
            continue
        if dry_run:
            current = Capability.objects.filter(scope=entry.declaration.scope).first()
            outcome = (
                Registered.CREATED
                if current is None
                else Registered.UNCHANGED
                if current.declaration == entry.declaration.raw
                else Registered.UPDATED
            )
        else:
            where = f"{source} {entry.method} {entry.path}"
            outcome = capability_register(
                declaration=entry.declaration, source=where, actor=actor
            ).outcome
        registered.append((entry, outcome))
    return ImportReport(registered, skipped)


def approval_needed(capability: Capability, arguments: Any, *, has_arguments: bool) -> bool:
    """Whether the declaration asks for approval of a call with these arguments.

    `approval.required`, or any `approval.when[]` condition that matches. When the
    conditions cannot be evaluated — only a digest was sent, or an argument's type
    does not fit its condition — the ledger assumes approval was needed.
    """
    approval = capability.declaration.get("approval") or {}
    if approval.get("required") is True:
        return True
    conditions = approval.get("when") or []
    if not conditions:
        return False
    if not has_arguments:
        return True
    try:
        return any(acc.condition_matches(condition, arguments) for condition in conditions)
    except acc.WrongType:
        return True
