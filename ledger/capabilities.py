"""The capability registry: ACC declarations in, versioned capabilities out."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from django.db import transaction
from django.db.models import Count, Max, QuerySet
from django.template.defaultfilters import pluralize

from ledger import acc, rate_enforcement
from ledger.chain import digest
from ledger.models import AdminAction, Capability, CapabilityDeclaration, Invocation
from ledger.policy import Flag
from ledger.probe_config import unidentified_rules

# The action log's records of the registry (ledger.integrity checks every capability
# against them).
DECLARATION_REGISTERED = "declaration_registered"
SETTINGS_CHANGED = "capability_settings_changed"

# What ACC declares, derived by the registry from a declaration, and what the ledger
# adds, set by administrators (DESIGN section 3).
DECLARED_FIELDS = (
    "enabled",
    "readonly",
    "idempotent",
    "risk_level",
    "subject_required",
    "audit_sensitive",
    "timeout_ms",
)
SETTINGS = (
    "idempotency_verified",
    "max_attempts",
    "grace_ms",
    "redact_paths",
    "probe",
    "rate_limit_enforced",
)


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


def _in_force(declaration: acc.Declaration, capability: Capability) -> bool:
    """Whether the row is what registering the declaration would make it: the same
    declaration registered again over a row changed outside the registry puts the row
    back, as a new version on the record."""
    derived = Capability()
    _apply(derived, declaration)
    same_fields = declared_fields_of(derived) == declared_fields_of(capability)
    return capability.declaration == declaration.raw and same_fields


@transaction.atomic
def capability_register(*, declaration: acc.Declaration, source: str, actor: str) -> Registration:
    """Register a declaration; a changed one becomes a new version, the old one kept."""
    capability = Capability.objects.select_for_update().filter(scope=declaration.scope).first()
    if capability is not None and _in_force(declaration, capability):
        return Registration(capability, Registered.UNCHANGED)
    outcome = Registered.CREATED if capability is None else Registered.UPDATED
    capability = capability or Capability(scope=declaration.scope)
    enforced_before = rate_enforcement.enforced_limit(capability)
    _apply(capability, declaration)
    capability.version += 1
    capability.save()
    _renumber_if_changed(capability, enforced_before)
    CapabilityDeclaration.objects.create(
        capability=capability,
        version=capability.version,
        declaration=declaration.raw,
        source=source,
        actor=actor,
    )
    AdminAction.record(
        actor=actor,
        action=DECLARATION_REGISTERED,
        target=capability.scope,
        details=registration_details(capability, source=source),
    )
    return Registration(capability, outcome)


def registration_details(capability: Capability, *, source: str) -> dict[str, Any]:
    """What the action log keeps of a registration: the version, the declaration's
    digest and the fields the registry derived from it (the risk default depends on the
    operation's method, which the declaration does not hold)."""
    return {
        "version": capability.version,
        "source": source,
        "digest": digest(capability.declaration),
        "fields": declared_fields_of(capability),
    }


def declared_fields_of(capability: Capability) -> dict[str, Any]:
    return {name: getattr(capability, name) for name in DECLARED_FIELDS}


def settings_of(capability: Capability) -> dict[str, Any]:
    return {name: getattr(capability, name) for name in SETTINGS}


# What a capability's settings are before anyone changes them, and what a row the
# registry never made a declaration for would say of the declared fields.
DEFAULT_SETTINGS = settings_of(Capability())
UNDECLARED_FIELDS = declared_fields_of(Capability())


def settings_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each setting `after` gives another value than `before`, `from` and `to`."""
    return {
        name: {"from": before[name], "to": after[name]}
        for name in SETTINGS
        if name in after and before[name] != after[name]
    }


def _renumber_if_changed(capability: Capability, before: rate_enforcement.RateLimit | None) -> None:
    """Count the admissions already made against a limit the ledger now enforces (or
    enforces otherwise): turned on mid-window, it would otherwise let up to twice the
    limit through in its first window."""
    if (limit := rate_enforcement.enforced_limit(capability)) != before:
        rate_enforcement.renumber(capability.scope, limit)


class ReasonRequired(ValueError):
    """A capability's settings change the retry decision, redaction or reconciliation
    of every later invocation: whoever changes them says why."""


@transaction.atomic
def capability_settings_change(
    *, scope: str, actor: str, reason: str, **settings: Any
) -> dict[str, dict[str, Any]]:
    """Change some of a capability's ledger settings (SETTINGS) and record the change
    in the action log with the settings it leaves; returns what changed, each setting
    `from` and `to` (empty, and nothing written, when nothing did)."""
    unknown = settings.keys() - set(SETTINGS)
    if unknown:
        raise TypeError(f"not ledger settings: {', '.join(sorted(unknown))}")
    capability = Capability.objects.select_for_update().get(scope=scope)
    before = settings_of(capability)
    enforced_before = rate_enforcement.enforced_limit(capability)
    for name, value in settings.items():
        setattr(capability, name, value)
    capability.full_clean(exclude=[*DECLARED_FIELDS, "scope", "declaration", "version"])
    after = settings_of(capability)
    changed = settings_changes(before, after)
    if not changed:
        return {}
    if not reason.strip():
        raise ReasonRequired("say why the settings change: the reason is kept with it")
    capability.save(update_fields=[*changed, "updated_at"])
    _renumber_if_changed(capability, enforced_before)
    AdminAction.record(
        actor=actor,
        action=SETTINGS_CHANGED,
        target=scope,
        reason=reason,
        details={"changed": changed, "settings": after},
    )
    return changed


UNDECLARED_SHOWN = 50


def called_undeclared(since: dt.datetime) -> list[dict[str, Any]]:
    """The scopes runtimes recorded intents for, since a time, with no capability
    registered under them (flagged `undeclared`): what an administrator may have to
    declare. Read through the flag's partial index; the latest called first."""
    rows = (
        Invocation.objects.filter(flags__contains=[Flag.UNDECLARED], created_at__gte=since)
        .values("capability_scope")
        .annotate(invocations=Count("id"), last_called=Max("created_at"))
        .order_by("-last_called")[:UNDECLARED_SHOWN]
    )
    declared_since = set(
        Capability.objects.filter(scope__in=[row["capability_scope"] for row in rows]).values_list(
            "scope", flat=True
        )
    )
    return [row | {"declared_since": row["capability_scope"] in declared_since} for row in rows]


# Counted to here and no further: a page about a capability escalated by the hundred
# thousand after an outage must still cost a page.
PROBES_COUNTED = 1000


def awaiting_its_probe(capability: Capability) -> str:
    """How many of its escalated invocations its probe could settle now, as a page says
    it ("3 escalated invocations"); empty if none."""
    n, more = Invocation.objects.awaiting_probe_of(capability).counted_up_to(PROBES_COUNTED)
    if more:
        return f"{n:,} or more escalated invocations"
    return f"{n} escalated invocation{pluralize(n)}" if n else ""


def probes_concluding_nothing() -> list[tuple[str, list[str]]]:
    """The capabilities whose http probe, saved before its rules had to name the
    business system's answer, has a rule that now concludes nothing, with those rules'
    names: a person decides each of their invocations until an administrator mends it."""
    http = Capability.objects.filter(probe__kind="http").order_by("scope")
    found = (
        (scope, unidentified_rules(probe)) for scope, probe in http.values_list("scope", "probe")
    )
    return [(scope, rules) for scope, rules in found if rules]


def capability_history(scope: str) -> QuerySet[AdminAction]:
    """What the action log recorded of a capability, newest first: each declaration
    registered and each settings change."""
    recorded = AdminAction.objects.filter(
        target=scope, action__in=(DECLARATION_REGISTERED, SETTINGS_CHANGED)
    )
    return recorded.order_by("-id")


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
                if _in_force(entry.declaration, current)
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
