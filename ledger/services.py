"""Writing evidence: intents, attempt admissions, outcomes and ledger-made flags.

Every write goes through one unit of work (`_Work`): it reads the invocations a
request touches with one statement, applies the items in order in memory through
`policy`, and writes every new row and changed projection with one more statement
(`ledger/store.py`). Nothing is locked in between: the write is a compare-and-set,
and a unit that lost a race (another request changed an invocation, or recorded the
same intent first) writes nothing and runs again, so it answers as a replay or a
conflict. A single API call is a batch of one, so `POST /api/v1/evidence` answers
exactly what the single calls would.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max, OuterRef, QuerySet, Subquery
from django.utils import timezone

from ledger import chain, policy, rate_enforcement, store
from ledger.capabilities import approval_needed
from ledger.models import (
    HAS_BUSINESS_REFERENCE,
    Attempt,
    Capability,
    Event,
    Invocation,
    Outcome,
    Runtime,
)

log = logging.getLogger(__name__)

RACE_RETRIES = 5
# A unit that has lost this many races in a row locks its invocations before it reads
# them again: many writers at one invocation (a dozen reports of one attempt at once)
# then take turns instead of some being refused after RACE_RETRIES.
LOCK_AFTER_RACES = 2


class LedgerError(Exception):
    """A typed refusal: the API turns it into `{"error": {type, message, details}}`."""

    def __init__(
        self,
        type: str,
        message: str,
        *,
        status: int = 409,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.type = type
        self.message = message
        self.status = status
        self.details = details or {}


@dataclass(frozen=True)
class IntentInput:
    invocation_id: str
    task_id: str
    capability: str
    idempotency_key: str
    subject: str = ""
    arguments: Any = None
    has_arguments: bool = False
    arguments_digest: str | None = None
    approval: dict[str, Any] | None = None
    traceparent: str = ""
    attempt_id: str | None = None
    requested_at: dt.datetime | None = None


@dataclass(frozen=True)
class AttemptInput:
    invocation_id: str
    attempt_id: str


@dataclass(frozen=True)
class OutcomeInput:
    invocation_id: str
    attempt_id: str
    kind: policy.OutcomeKind
    retryable: bool = False
    business_reference: str = ""
    result: Any = None
    result_digest: str = ""  # set when a result was sent
    error_code: str = ""
    error_message: str = ""
    completed_at: dt.datetime | None = None


EvidenceInput = IntentInput | AttemptInput | OutcomeInput


@dataclass(frozen=True)
class Applied:
    """One item's answer: `created` is False for an idempotent replay."""

    invocation: Invocation
    created: bool
    state: dict[str, Any]


ItemResult = Applied | LedgerError


def typed_state(invocation: Invocation) -> dict[str, Any]:
    """The body every write and read returns (DESIGN section 5)."""
    state = invocation.state()
    return {
        "invocation_id": invocation.invocation_id,
        "status": state.status.value,
        "failure_class": state.failure_class.value if state.failure_class else None,
        "cause": state.cause.value if state.cause else None,
        "retryable": state.retryable,
        "reconciliation_required": state.reconciliation_required,
        "next_action": state.next_action.value,
        "flags": list(invocation.flags),
    }


def _state_summary(invocation: Invocation) -> dict[str, Any]:
    return {
        "status": invocation.status,
        "failure_class": invocation.failure_class or None,
        "cause": invocation.cause or None,
        "resolution": invocation.resolution or None,
        "flags": list(invocation.flags),
        "attempt_count": invocation.attempt_count,
        "in_flight_attempt": invocation.in_flight_attempt or None,
    }


def _disagreement(
    invocation: Invocation, head: store.Head | None, owner: Runtime | None = None
) -> list[str]:
    """The row's columns that differ from the event it counts as its last, or from
    what its intent recorded; with `owner`, the runtime the row names, also whether
    that runtime recorded the intent (edited, the row would hand the invocation to
    another runtime)."""
    if head is None:
        return ["event_count"]
    fields = sorted(invocation.differences_from(head.state, head.intent))
    if invocation.head_hash != head.hash:
        fields.append("head_hash")
    if (
        owner is not None
        and invocation.runtime_id == owner.pk  # type: ignore[attr-defined]
        and head.intent_actor not in ("", runtime_actor(owner))
    ):
        fields.append("runtime")
    return fields


def _rows_disagreeing(fields: dict[str, list[str]]) -> LedgerError:
    """projection_broken for rows whose fields differ from their last events'."""
    listed = "; ".join(f"{i}: {', '.join(names)}" for i, names in sorted(fields.items()))
    return projection_broken(sorted(fields), f"no longer agrees with its events ({listed})")


def projection_broken(invocation_ids: list[str], how: str) -> LedgerError:
    """The refusal of a unit touching rows that were changed outside the ledger: naming
    them, and what puts them back. Nothing of the unit is written."""
    log.error("projection broken invocations=%s: %s", ",".join(invocation_ids), how)
    return LedgerError(
        "projection_broken",
        f"The ledger's record of {', '.join(invocation_ids)} {how}: it was changed outside "
        "the ledger. Nothing was recorded. An administrator checks it with "
        "`manage.py verify_ledger --projections` and puts it back from its events with "
        "`manage.py restore_projection` or from the invocation's page in the console.",
        status=500,
        details={"invocation_ids": invocation_ids},
    )


def runtime_actor(runtime: Runtime) -> str:
    return f"runtime:{runtime.name}"


@dataclass
class _Work:
    """The rows one request touches, loaded once, changed in memory, written once."""

    runtime: Runtime | None
    now: dt.datetime
    invocations: dict[str, Invocation] = field(default_factory=dict)
    by_key: dict[tuple[str, str], Invocation] = field(default_factory=dict)
    attempts: dict[str, dict[str, Attempt | store.NewAttempt]] = field(default_factory=dict)
    outcomes: dict[tuple[str, str], Outcome] = field(default_factory=dict)
    capabilities: dict[str, Capability | None] = field(default_factory=dict)
    new_invocations: list[Invocation] = field(default_factory=list)
    new_attempts: list[store.NewAttempt] = field(default_factory=list)
    # With the owner's invocation_id, the attempt_id and, if already stored, its pk.
    new_outcomes: list[tuple[Outcome, str, str, int | None]] = field(default_factory=list)
    new_events: list[tuple[store.PlainEvent, str]] = field(default_factory=list)
    dirty: dict[str, Invocation] = field(default_factory=dict)
    read_event_count: dict[str, int] = field(default_factory=dict)
    unchanged_capabilities: dict[str, store.KnownCapability] = field(default_factory=dict)
    # Business reference -> {invocation_id: runtime id} of the invocations whose
    # evidence names it, as read, and as this unit's own successes add to it.
    named_by: dict[str, dict[str, int]] = field(default_factory=dict)
    # The references that no invocation's evidence named when this unit read them.
    # The write claims each one this unit names (store.Writes.new_references).
    unnamed: set[str] = field(default_factory=set)
    # Off only for restore_projection, which loads a row that disagrees to put it back.
    checks_projection: bool = True
    # What the enforced rate limits of the unit's capabilities leave it, by scope, with
    # the admissions it made under them (`ledger.rate_enforcement`).
    rate_rooms: dict[str, rate_enforcement.Room] = field(default_factory=dict)

    # Loading ---------------------------------------------------------------

    def load_items(self, items: Sequence[EvidenceInput]) -> None:
        intents = [item for item in items if isinstance(item, IntentInput)]
        self.load(
            ids={item.invocation_id for item in items},
            scopes={item.capability for item in intents},
            keys={item.idempotency_key for item in intents},
            # Every outcome's reference, not only a success's: a failure or a conflicting
            # claim names one in its event too, and flush would otherwise read it again.
            references={item.business_reference for item in items if isinstance(item, OutcomeInput)}
            - {""},
        )

    def load(
        self,
        *,
        ids: set[str],
        scopes: set[str] = set(),  # noqa: B006
        keys: set[str] = set(),  # noqa: B006
        references: set[str] = set(),  # noqa: B006
    ) -> None:
        loaded = store.load(
            ids=ids, scopes=scopes, keys=keys, references=references, confirm_token=self._token()
        )
        self._token_confirmed()
        self._read_named(loaded.named_by)
        found = {capability.scope: capability for capability in loaded.capabilities}
        self.capabilities = {scope: found.get(scope) for scope in scopes}
        disagreeing: dict[str, list[str]] = {}
        for invocation, attempts in loaded.invocations:
            self._remember(invocation)
            self.read_event_count[invocation.invocation_id] = invocation.event_count
            for attempt, outcome in attempts:
                self.attempts[invocation.invocation_id][attempt.attempt_id] = attempt
                if outcome is not None:
                    self.outcomes[invocation.invocation_id, attempt.attempt_id] = outcome
            if self.checks_projection:
                head = loaded.heads[invocation.invocation_id]
                if fields := _disagreement(invocation, head, self.runtime):
                    disagreeing[invocation.invocation_id] = fields
        if disagreeing:
            # Its state would be decided from a row its events do not explain (edited to
            # retry_allowed, it would admit a second refund) and its next event chained
            # to a head that is not the chain's.
            raise _rows_disagreeing(disagreeing)

    def _read_named(self, named_by: dict[str, dict[str, int]]) -> None:
        for reference, named in named_by.items():
            self.named_by[reference] = dict(named)
            if not named:
                self.unnamed.add(reference)

    def assume_new(self, known: dict[str, store.KnownCapability]) -> None:
        """Read nothing: every intent is taken as new, under capabilities remembered
        (or none, for a scope remembered unregistered: undeclared).

        The write inserts no invocation that already exists and checks that the
        capabilities still read the same; if either fails, it writes nothing.
        """
        self.capabilities = {scope: entry.capability for scope, entry in known.items()}
        self.unchanged_capabilities = dict(known)

    def claim_kept(self, invocation: Invocation, attempt_id: str, claim: dict[str, Any]) -> bool:
        """Whether this conflicting claim about the attempt is already kept: in this
        unit, or in an event stored before it (read only on this rare path)."""
        pending = (
            (event.data["attempt_id"], event.data["claimed"])
            for event, owner in self.new_events
            if owner == invocation.invocation_id and event.kind == "outcome_conflict"
        )
        if (attempt_id, claim) in pending:
            return True
        if invocation.pk is None:
            return False
        kept = Event.objects.of(invocation).filter(
            kind="outcome_conflict",
            data__attempt_id=attempt_id,
            data__claimed=claim,
        )
        return kept.exists()

    def also_naming(self, invocation: Invocation, reference: str) -> dict[str, int]:
        """The other invocations whose evidence names the reference this invocation's
        success names, with their runtimes; the reference is then named by this one too."""
        if not reference:
            return {}
        named = self.named_by.setdefault(reference, {})
        others = {
            other: runtime for other, runtime in named.items() if other != invocation.invocation_id
        }
        named[invocation.invocation_id] = invocation.runtime_id
        return others

    def _remember(self, invocation: Invocation) -> None:
        self.invocations[invocation.invocation_id] = invocation
        self.by_key[invocation.capability_scope, invocation.idempotency_key] = invocation
        self.attempts.setdefault(invocation.invocation_id, {})

    def owned(self, invocation_id: str) -> Invocation:
        invocation = self.invocations.get(invocation_id)
        if invocation is None or (
            self.runtime is not None and invocation.runtime_id != self.runtime.pk  # type: ignore[attr-defined]
        ):
            # Another runtime's invocation is as invisible as a missing one.
            raise LedgerError("not_found", "no such invocation", status=404)
        return invocation

    # Writing ---------------------------------------------------------------

    def event(self, invocation: Invocation, kind: str, actor: str, data: dict[str, Any]) -> None:
        invocation.event_count += 1
        body = {"state": _state_summary(invocation), **data}
        event = store.PlainEvent(
            seq=invocation.event_count,
            kind=kind,
            actor=actor,
            data=body,
            created_at=self.now,
            prev_hash=invocation.head_hash,
        )
        event.hash = chain.event_hash(event.prev_hash, event_body(event, invocation.invocation_id))
        invocation.head_hash = event.hash
        invocation.updated_at = self.now
        # Every change of state comes with its event, so here the wait is timed.
        if invocation.status in policy.NEEDS_RECONCILIATION:
            invocation.flagged_at = invocation.flagged_at or self.now
        else:
            invocation.flagged_at = None
        self.new_events.append((event, invocation.invocation_id))
        if invocation.pk is not None:
            self.dirty[invocation.invocation_id] = invocation

    def flush(self) -> None:
        if not (self.new_invocations or self.dirty):
            return
        new_references = self._new_references()
        try:
            store.write(
                store.Writes(
                    new_invocations=self.new_invocations,
                    updated=[
                        (row, self.read_event_count[invocation_id])
                        for invocation_id, row in self.dirty.items()
                    ],
                    new_attempts=self.new_attempts,
                    new_outcomes=self.new_outcomes,
                    new_events=self.new_events,
                    new_references=new_references,
                    unchanged_capabilities=self.unchanged_capabilities,
                    confirm_token=self._token(),
                )
            )
        except store.ProjectionBehind:
            raise self._projection_behind() from None
        self._token_confirmed()

    def _projection_behind(self) -> LedgerError:
        """For a unit whose invocations' rows count fewer events than they have."""
        last_seq = dict(
            Event.objects.filter(invocation_id__in=[row.pk for row in self.dirty.values()])
            .values_list("invocation__invocation_id")
            .annotate(Max("seq"))
        )
        behind = sorted(
            invocation_id
            for invocation_id, read in self.read_event_count.items()
            if last_seq.get(invocation_id, 0) > read
        )
        return projection_broken(behind, "counts fewer events than it has")

    def _new_references(self) -> list[tuple[str, str]]:
        """The references this unit's events name that no one named when read, each
        with the first invocation here to name it, in the references' order.

        A reference the unit did not read (a probe's finding, a person's resolution)
        is read now: the rare paths pay that query, not the hot one.
        """
        first: dict[str, str] = {}
        for event, owner in self.new_events:
            reference = event.data.get("business_reference")
            if reference and isinstance(reference, str):
                first.setdefault(reference, owner)
        unread = first.keys() - self.named_by.keys()
        if unread:
            self._read_named(store.load(ids=(), scopes=(), keys=(), references=unread).named_by)
        return sorted(
            (reference, owner) for reference, owner in first.items() if reference in self.unnamed
        )

    def _token(self) -> int | None:
        """The runtime's token, if it still has to be confirmed by a statement."""
        return self.runtime.unconfirmed_token_id if self.runtime is not None else None

    def _token_confirmed(self) -> None:
        if self.runtime is not None:
            self.runtime.unconfirmed_token_id = None


def event_body(event: Event | store.PlainEvent, invocation_id: str) -> dict[str, Any]:
    """What an event's hash covers: everything but its own hash."""
    return {
        "invocation_id": invocation_id,
        "seq": event.seq,
        "kind": event.kind,
        "actor": event.actor,
        "data": event.data,
        "created_at": event.created_at.astimezone(dt.UTC).isoformat(),
        "prev_hash": event.prev_hash,
    }


# The items -----------------------------------------------------------------


def _deadline(invocation: Invocation, now: dt.datetime) -> dt.datetime:
    return now + dt.timedelta(milliseconds=invocation.timeout_ms + invocation.grace_ms)


def _within_rate_limit(work: _Work, scope: str) -> None:
    """Refuse an admission that the capability's enforced rate limit has no room for:
    429, nothing changed, with when to ask again."""
    room = work.rate_rooms.get(scope)
    if room is not None and room.full(work.now):
        count, window = room.limit.declared["count"], room.limit.declared["window"]
        raise LedgerError(
            "rate_limited",
            f"{scope} admits at most {count} attempts per {window}, across every runtime; "
            "nothing was recorded: send the same request again after retry_after_seconds.",
            status=429,
            details=room.refusal(work.now),
        )


def _admit(work: _Work, invocation: Invocation, attempt_id: str, actor: str) -> bool:
    """Admit `attempt_id`; False when it was already admitted (a replay)."""
    if attempt_id in work.attempts[invocation.invocation_id]:
        return False
    try:
        state = policy.admit(invocation.state(), invocation.hints(), attempt_id)
    except policy.Refused as refused:
        raise LedgerError(
            refused.reason,
            refused.message,
            details={"state": typed_state(invocation), "attempt_id": attempt_id},
        ) from None
    _within_rate_limit(work, invocation.capability_scope)
    invocation.apply_state(state)
    invocation.deadline_at = _deadline(invocation, work.now)
    attempt = store.NewAttempt(
        owner=invocation.invocation_id,
        attempt_id=attempt_id,
        number=state.attempts,
        admitted_at=work.now,
        deadline_at=invocation.deadline_at,
    )
    work.attempts[invocation.invocation_id][attempt_id] = attempt
    work.new_attempts.append(attempt)
    if room := work.rate_rooms.get(invocation.capability_scope):
        room.take(work.now, invocation.invocation_id, attempt_id)
    work.event(
        invocation,
        "attempt_admitted",
        actor,
        {
            "attempt_id": attempt_id,
            "number": attempt.number,
            "deadline_at": attempt.deadline_at.isoformat(),
        },
    )
    return True


def _stored_copy(value: Any, capability: Capability | None) -> Any:
    paths = capability.redact_paths if capability else ()
    mask_all = bool(capability and capability.audit_sensitive and not paths)
    return chain.redact(value, paths, mask_all=mask_all)


def _governance(item: IntentInput, capability: Capability | None) -> list[str]:
    """ACC governance at intent time: refusals raise, findings become flags."""
    if capability is None:
        return [policy.Flag.UNDECLARED.value]
    if not capability.enabled:
        raise LedgerError(
            "capability_disabled",
            f"capability {capability.scope!r} is disabled",
            status=422,
            details={"capability": capability.scope},
        )
    if capability.subject_required and not item.subject:
        raise LedgerError(
            "subject_required",
            f"capability {capability.scope!r} requires a subject",
            status=422,
            details={"subject": ["This capability requires a subject."]},
        )
    if not item.approval and approval_needed(
        capability, item.arguments, has_arguments=item.has_arguments
    ):
        return [policy.Flag.APPROVAL_MISSING.value]
    return []


def _intent_differences(
    invocation: Invocation, item: IntentInput, arguments_digest: str
) -> list[str]:
    compared = {
        "task_id": (invocation.task_id, item.task_id),
        "capability": (invocation.capability_scope, item.capability),
        "subject": (invocation.subject, item.subject),
        "idempotency_key": (invocation.idempotency_key, item.idempotency_key),
        "arguments": (invocation.arguments_digest, arguments_digest),
        "approval": (invocation.approval, item.approval),
    }
    return sorted(name for name, (stored, sent) in compared.items() if stored != sent)


def _apply_intent(work: _Work, item: IntentInput) -> Applied:
    assert work.runtime is not None
    actor = runtime_actor(work.runtime)
    arguments_digest = item.arguments_digest
    assert arguments_digest is not None, "the serializer digests the arguments"
    existing = work.invocations.get(item.invocation_id)
    if existing is not None:
        if existing.runtime_id != work.runtime.pk:  # type: ignore[attr-defined]
            raise LedgerError(
                "intent_conflict", "this invocation_id is already used by another runtime"
            )
        differing = _intent_differences(existing, item, arguments_digest)
        if differing:
            raise LedgerError(
                "intent_conflict",
                "an intent with this invocation_id was recorded with different content",
                details={"fields": differing},
            )
        created = bool(item.attempt_id) and _admit(work, existing, item.attempt_id or "", actor)
        return Applied(existing, created, typed_state(existing))

    holder = work.by_key.get((item.capability, item.idempotency_key))
    if holder is not None:
        details = {"capability": item.capability, "idempotency_key": item.idempotency_key}
        if holder.runtime_id == work.runtime.pk:  # type: ignore[attr-defined]
            details["invocation_id"] = holder.invocation_id
        raise LedgerError(
            "idempotency_key_in_use",
            "this capability and idempotency key are bound to another invocation",
            details=details,
        )

    if item.attempt_id:  # refused before anything of the intent is recorded
        _within_rate_limit(work, item.capability)
    capability = work.capabilities.get(item.capability)
    flags = _governance(item, capability)
    hints = capability.hints() if capability else policy.CONSERVATIVE_HINTS
    invocation = store.new_instance(
        Invocation,
        invocation_id=item.invocation_id,
        runtime_id=work.runtime.pk,
        task_id=item.task_id,
        capability_id=capability.pk if capability else None,
        capability_scope=item.capability,
        capability_version=capability.version if capability else None,
        subject=item.subject,
        idempotency_key=item.idempotency_key,
        arguments=_stored_copy(item.arguments, capability) if item.has_arguments else None,
        arguments_digest=arguments_digest,
        approval=item.approval,
        traceparent=item.traceparent,
        requested_at=item.requested_at,
        created_at=work.now,
        hint_readonly=hints.readonly,
        hint_idempotency_verified=hints.idempotency_verified,
        max_attempts=hints.max_attempts,
        timeout_ms=(capability and capability.timeout_ms) or settings.LEDGER_DEFAULT_TIMEOUT_MS,
        grace_ms=(capability and capability.grace_ms) or settings.LEDGER_DEFAULT_GRACE_MS,
        risk_level=capability.risk_level if capability else Capability.Risk.HIGH.value,
        status=policy.Status.RECORDED.value,
        flags=flags,
        head_hash=chain.GENESIS_HASH,
        updated_at=work.now,
    )
    if capability is not None:
        invocation.capability = capability  # an outcome in the same unit redacts with it
    work.new_invocations.append(invocation)
    work._remember(invocation)
    work.event(
        invocation,
        "intent_recorded",
        actor,
        {
            "task_id": item.task_id,
            "capability": item.capability,
            "capability_version": invocation.capability_version,
            "subject": item.subject,
            "idempotency_key": item.idempotency_key,
            "arguments_digest": arguments_digest,
            "approval": item.approval,
            "traceparent": item.traceparent or None,
            "requested_at": item.requested_at.isoformat() if item.requested_at else None,
            "hints": {
                "readonly": hints.readonly,
                "idempotency_verified": hints.idempotency_verified,
                "max_attempts": hints.max_attempts,
                "risk": invocation.risk_level,
            },
        },
    )
    if item.attempt_id:
        _admit(work, invocation, item.attempt_id, actor)
    return Applied(invocation, True, typed_state(invocation))


def _apply_attempt(work: _Work, item: AttemptInput) -> Applied:
    assert work.runtime is not None
    invocation = work.owned(item.invocation_id)
    created = _admit(work, invocation, item.attempt_id, runtime_actor(work.runtime))
    return Applied(invocation, created, typed_state(invocation))


def _outcome_claim(item: OutcomeInput) -> dict[str, Any]:
    return {
        "kind": item.kind.value,
        "retryable": item.retryable,
        "business_reference": item.business_reference,
        "result_digest": item.result_digest,
        "error_code": item.error_code,
    }


def _apply_outcome(work: _Work, item: OutcomeInput) -> Applied:
    assert work.runtime is not None
    actor = runtime_actor(work.runtime)
    invocation = work.owned(item.invocation_id)
    attempt = work.attempts[invocation.invocation_id].get(item.attempt_id)
    if attempt is None:
        raise LedgerError(
            "not_found",
            "no such attempt for this invocation",
            status=404,
            details={"attempt_id": item.attempt_id},
        )
    claim = _outcome_claim(item)
    recorded = work.outcomes.get((invocation.invocation_id, item.attempt_id))
    if recorded is not None:
        kept = _outcome_claim(
            OutcomeInput(
                invocation_id=item.invocation_id,
                attempt_id=item.attempt_id,
                kind=policy.OutcomeKind(recorded.kind),
                retryable=recorded.retryable,
                business_reference=recorded.business_reference,
                result_digest=recorded.result_digest,
                error_code=recorded.error_code,
            )
        )
        if kept == claim:
            return Applied(invocation, False, typed_state(invocation))
        # The contradicting claim is evidence too: keep it, flag the invocation. The
        # same claim sent again is a replay, answered alike and kept once: a runtime
        # retrying its 409 must not grow the chain with every try.
        if not work.claim_kept(invocation, item.attempt_id, claim):
            invocation.flags = sorted({*invocation.flags, policy.Flag.EVIDENCE_CONFLICT.value})
            work.event(
                invocation,
                "outcome_conflict",
                actor,
                {
                    "attempt_id": item.attempt_id,
                    "claimed": claim,
                    "recorded": kept,
                    # At the top, as in every event that names a reference, so that
                    # the search by reference and the links between invocations find it.
                    "business_reference": claim["business_reference"],
                },
            )
        raise LedgerError(
            "outcome_conflict",
            "a different outcome was already recorded for this attempt",
            details={
                "fields": sorted(k for k in claim if claim[k] != kept[k]),
                "state": typed_state(invocation),
            },
        )
    late = invocation.in_flight_attempt != item.attempt_id
    state = policy.report_outcome(
        invocation.state(),
        invocation.hints(),
        item.attempt_id,
        attempt.number,
        item.kind,
        item.retryable,
        names_another_effect=late and _names_another_effect(invocation, item),
    )
    also_named = work.also_naming(invocation, _effect_reference(item))
    if also_named:
        state = policy.with_flag(state, policy.Flag.REFERENCE_SHARED)
    invocation.apply_state(state)
    outcome = Outcome(
        kind=item.kind.value,
        retryable=item.retryable,
        business_reference=item.business_reference,
        result=_stored_copy(item.result, invocation.capability) if item.result_digest else None,
        result_digest=item.result_digest,
        error_code=item.error_code,
        error_message=item.error_message,
        completed_at=item.completed_at,
        recorded_at=work.now,
    )
    work.outcomes[invocation.invocation_id, item.attempt_id] = outcome
    work.new_outcomes.append((outcome, invocation.invocation_id, item.attempt_id, attempt.pk))
    work.event(
        invocation,
        "late_outcome_recorded" if late else "outcome_recorded",
        actor,
        {
            "attempt_id": item.attempt_id,
            **claim,
            "error_message": item.error_message,
            "completed_at": item.completed_at.isoformat() if item.completed_at else None,
            **shared_reference_data(also_named, invocation.runtime_id),
        },
    )
    return Applied(invocation, True, typed_state(invocation))


def shared_reference_data(others: Mapping[str, int], runtime_id: int) -> dict[str, Any]:
    """What an event records of the other invocations whose evidence names its business
    reference: the ids of those of its own runtime, and only how many belong to other
    runtimes. A runtime reads its invocations' events and never learns another
    runtime's invocations (DESIGN §5: those are 404 to it); the console and the audit
    search by reference show people all of them."""
    own = sorted(other for other, runtime in others.items() if runtime == runtime_id)
    elsewhere = len(others) - len(own)
    return {
        **({"also_named_by": own} if own else {}),
        **({"also_named_elsewhere": elsewhere} if elsewhere else {}),
    }


def _effect_reference(item: EvidenceInput) -> str:
    """The business reference a success names: the effect's name in the business."""
    if isinstance(item, OutcomeInput) and item.kind is policy.OutcomeKind.SUCCEEDED:
        return item.business_reference
    return ""


def _names_another_effect(invocation: Invocation, item: OutcomeInput) -> bool:
    """Whether a late success names a business reference that none of the evidence
    already settling this invocation as an effect names, when that evidence names one:
    two references for one intent may be two effects. Read only on this rare path."""
    settled_present = invocation.resolution == policy.Effect.PRESENT.value
    if not (settled_present and item.business_reference and invocation.pk is not None):
        return False
    named = set(
        Event.objects.of(invocation)
        .filter(HAS_BUSINESS_REFERENCE)
        .values_list("data__business_reference", flat=True)
    )
    return bool(named) and item.business_reference not in named


APPLY = {IntentInput: _apply_intent, AttemptInput: _apply_attempt, OutcomeInput: _apply_outcome}


def apply_evidence(*, runtime: Runtime, items: Sequence[EvidenceInput]) -> list[ItemResult]:
    """Apply items in order, all or nothing; one result per item.

    Nothing is locked while the items are applied in memory: the write checks that
    no invocation changed since it was read, and on a lost race the whole unit is
    read and applied again, so it answers as if it had come second. After
    LOCK_AFTER_RACES lost races in a row it locks its invocations first, in a
    transaction, so that it cannot lose again to a write of theirs.

    A unit of new intents under capabilities this process has read before skips the
    read: it is applied as if nothing existed yet, and only if the write then finds
    every invocation new and every capability unchanged, and every item applied
    cleanly, is that the answer. Otherwise (a replay, a conflict, a changed or
    refusing capability) the unit is read and applied again.
    """
    known = _known_capabilities_of_new_intents(items)
    races = 0
    while True:
        try:
            with _unit_scope(races, {item.invocation_id for item in items}):
                results = _apply_once(runtime, items, known)
            _log_rate_limited(runtime, results)
            return results
        except _ReadFirst:
            known = None  # a refusal is only answered from what was read
        except store.RaceLost:
            if known is not None:
                known = None  # the assumption was wrong: read, and apply again
                continue
            races += 1
            log.info(
                "evidence race lost runtime=%s items=%d try=%d", runtime.name, len(items), races
            )
            if races >= RACE_RETRIES:
                raise LedgerError(
                    "ledger_unavailable",
                    "The invocation kept changing under this request. Nothing was recorded; "
                    "it is safe to send the same request again.",
                    status=503,
                ) from None


def _log_rate_limited(runtime: Runtime, results: Sequence[ItemResult]) -> None:
    """One line a unit for the admissions an enforced rate limit refused, by capability:
    a refusal records nothing, and the access log says only 429, not whose limit."""
    refused = [r for r in results if isinstance(r, LedgerError) and r.type == "rate_limited"]
    by_capability = Counter(error.details["capability"] for error in refused)
    for scope, count in by_capability.items():
        log.info("rate limited runtime=%s capability=%s refused=%d", runtime.name, scope, count)


def _unit_scope(races: int, invocation_ids: set[str]) -> AbstractContextManager[None]:
    """Nothing for a unit that has not lost LOCK_AFTER_RACES races; after that, a
    transaction that holds its invocations while it reads and writes them."""
    return nullcontext() if races < LOCK_AFTER_RACES else _holding(invocation_ids)


@contextmanager
def _holding(invocation_ids: set[str]) -> Iterator[None]:
    with transaction.atomic():
        store.lock_invocations(invocation_ids)
        yield


class _ReadFirst(Exception):
    """Applied as all new without reading, the unit was refused: read, and apply again."""


def _apply_once(
    runtime: Runtime, items: Sequence[EvidenceInput], known: dict[str, store.KnownCapability] | None
) -> list[ItemResult]:
    work = _Work(runtime=runtime, now=timezone.now())
    if known is not None:
        work.assume_new(known)
    else:
        work.load_items(items)
    limits, admitting = _enforced_rate_limits(work, items)
    if not limits:
        return _applied(work, items, assumed_new=known is not None)
    with transaction.atomic():
        work.rate_rooms = rate_enforcement.rooms(limits, admitting)
        # Read again once the lock is held: the capability's admissions are then in the
        # order of their times, as the window judges them, however long the wait was.
        work.now = timezone.now()
        results = _applied(work, items, assumed_new=known is not None)
        rate_enforcement.record_admissions(work.rate_rooms)
        return results


def _applied(work: _Work, items: Sequence[EvidenceInput], *, assumed_new: bool) -> list[ItemResult]:
    results: list[ItemResult] = []
    for item in items:
        try:
            results.append(APPLY[type(item)](work, item))  # type: ignore[operator]
        except LedgerError as error:
            results.append(error)
    if assumed_new and any(isinstance(result, LedgerError) for result in results):
        raise _ReadFirst
    work.flush()
    return results


def _enforced_rate_limits(
    work: _Work, items: Sequence[EvidenceInput]
) -> tuple[dict[str, rate_enforcement.RateLimit], Counter[str]]:
    """The enforced rate limits of the capabilities under which these items may admit
    an attempt (an intent's with its first attempt, an attempt's invocation's), and how
    many items may admit under each. An attempt's capability is read only when the unit
    holds attempts: retries, not the intent-and-outcome path."""
    admitting = Counter(
        item.capability for item in items if isinstance(item, IntentInput) and item.attempt_id
    )
    capabilities = [work.capabilities.get(scope) for scope in admitting]
    retried = Counter(
        work.invocations[item.invocation_id].capability_scope
        for item in items
        if isinstance(item, AttemptInput) and item.invocation_id in work.invocations
    )
    if unread := retried.keys() - admitting.keys():
        capabilities += Capability.objects.filter(scope__in=unread, rate_limit_enforced=True)
    admitting.update(retried)
    return rate_enforcement.enforced_limits(capabilities), admitting


def _known_capabilities_of_new_intents(
    items: Sequence[EvidenceInput],
) -> dict[str, store.KnownCapability] | None:
    intents = [item for item in items if isinstance(item, IntentInput)]
    if len(intents) < len(items):
        return None
    return store.known_capabilities({item.capability for item in intents})


def _single(runtime: Runtime, item: EvidenceInput) -> Applied:
    (result,) = apply_evidence(runtime=runtime, items=[item])
    if isinstance(result, LedgerError):
        raise result
    return result


def record_intent(*, runtime: Runtime, intent: IntentInput) -> Applied:
    return _single(runtime, intent)


def admit_attempt(*, runtime: Runtime, invocation_id: str, attempt_id: str) -> Applied:
    return _single(runtime, AttemptInput(invocation_id=invocation_id, attempt_id=attempt_id))


def record_outcome(*, runtime: Runtime, outcome: OutcomeInput) -> Applied:
    return _single(runtime, outcome)


def with_heads(rows: QuerySet[Invocation]) -> QuerySet[Invocation]:
    """The rows, each with the recorded state and hash of the event it counts as its
    last, and the data and actor of its intent's event (`refuse_rows_disagreeing`
    compares them)."""
    # Each in the row's own month partition (`Event.objects.of`).
    events = Event.objects.filter(
        invocation=OuterRef("pk"), invocation_created_at=OuterRef("created_at")
    )
    head = events.filter(seq=OuterRef("event_count"))
    intent = events.filter(seq=1)
    return rows.annotate(
        head_state=Subquery(head.values("data__state")),
        head_event_hash=Subquery(head.values("hash")),
        intent_data=Subquery(intent.values("data")),
        intent_actor=Subquery(intent.values("actor")),
    )


def rows_disagreeing(
    rows: Iterable[Invocation], owner: Runtime | None = None
) -> dict[str, list[str]]:
    """The fields of each row (`with_heads`) that disagree with its events, by
    invocation id, for the rows that do (`_disagreement`; with `owner`, the runtime
    asking, also whether that runtime recorded the intent of a row naming it)."""
    disagreeing = {}
    for row in rows:
        state, hash_ = row.head_state, row.head_event_hash  # type: ignore[attr-defined]
        intent, actor = row.intent_data or {}, row.intent_actor or ""  # type: ignore[attr-defined]
        head = store.Head(state or {}, hash_, intent, actor) if hash_ else None
        if fields := _disagreement(row, head, owner):
            disagreeing[row.invocation_id] = fields
    return disagreeing


def refuse_rows_disagreeing(rows: Iterable[Invocation], owner: Runtime) -> None:
    """projection_broken if a row (`with_heads`) of `owner` disagrees with its events:
    its typed state would tell a runtime what no event says."""
    if disagreeing := rows_disagreeing(rows, owner):
        raise _rows_disagreeing(disagreeing)


def invocation_detail(*, runtime: Runtime, invocation_id: str) -> store.Detail | None:
    """The runtime's own invocation with its attempts, outcomes and events, or None.

    A row its events do not explain is refused as a write touching it would be: its
    typed state would tell the runtime what no event says (retryable, say)."""
    found = store.detail(
        invocation_id=invocation_id,
        runtime_id=runtime.pk,
        confirm_token=runtime.unconfirmed_token_id,
    )
    runtime.unconfirmed_token_id = None
    if found is not None and (fields := disagreement(found.invocation, found.events, runtime)):
        raise _rows_disagreeing({invocation_id: fields})
    return found


def disagreement(
    invocation: Invocation, events: Iterable[Event], owner: Runtime | None = None
) -> list[str]:
    """The row's columns that differ from its `events` (`_disagreement`): a row
    changed outside the ledger, which nothing acts on."""
    events = list(events)
    last = next((e for e in events if e.seq == invocation.event_count), None)
    if last is None:
        return _disagreement(invocation, None)
    intent = next((e for e in events if e.seq == 1), None)
    recorded_intent, intent_actor = (intent.data, intent.actor) if intent else ({}, "")
    head = store.Head(last.data.get("state", {}), last.hash, recorded_intent, intent_actor)
    return _disagreement(invocation, head, owner)


def invocation_transition(
    *,
    invocation_id: str,
    actor: str,
    kind: str,
    change: Callable[[Invocation], dict[str, Any] | None],
    now: dt.datetime | None = None,
    checks_projection: bool = True,
) -> Invocation | None:
    """Change one invocation and append the event that explains the change.

    `change` updates the loaded invocation (through `policy`) and returns the event's
    data, or None when there is nothing to do. The write is a compare-and-set: if
    another request changed the invocation meanwhile, it is loaded again and
    `change` asked again. Returns the changed invocation, or None.
    """
    changed = invocation_transitions(
        invocation_ids=[invocation_id],
        actor=actor,
        kind=kind,
        change=change,
        now=now,
        must_exist=True,
        checks_projection=checks_projection,
    )
    return changed[0] if changed else None


def invocation_transitions(
    *,
    invocation_ids: Sequence[str],
    actor: str,
    kind: str,
    change: Callable[[Invocation], dict[str, Any] | None],
    now: dt.datetime | None = None,
    must_exist: bool = False,
    checks_projection: bool = True,
) -> list[Invocation]:
    """`invocation_transition` for many invocations: one read, one write, the changed.

    If another request changed any of them meanwhile, the write changes nothing and
    all are loaded and `change` asked again. Invocations that do not exist are
    skipped, or with `must_exist` refused as not found.
    """
    for races in range(RACE_RETRIES):
        try:
            with _unit_scope(races, set(invocation_ids)):
                work = _Work(
                    runtime=None, now=now or timezone.now(), checks_projection=checks_projection
                )
                work.load(ids=set(invocation_ids))
                changed = []
                for invocation_id in invocation_ids:
                    invocation = work.invocations.get(invocation_id)
                    if invocation is None:
                        if must_exist:
                            raise LedgerError("not_found", "no such invocation", status=404)
                        continue
                    data = change(invocation)
                    if data is not None:
                        work.event(invocation, kind, actor, data)
                        changed.append(invocation)
                work.flush()
        except store.RaceLost:
            continue
        return changed
    raise LedgerError(
        "ledger_unavailable",
        "The invocation kept changing; nothing was recorded. Try again.",
        status=503,
    )


SWEEPER = "ledger:sweeper"


def _flag_if_overdue(invocation: Invocation, now: dt.datetime) -> dict[str, Any] | None:
    """Classify an in-flight attempt past its deadline as evidence missing: the data of
    the event that explains it, or None when there is nothing to flag."""
    deadline = invocation.deadline_at
    if invocation.status != policy.Status.IN_FLIGHT or deadline is None or deadline > now:
        return None
    attempt_id = invocation.in_flight_attempt
    invocation.apply_state(
        policy.flag_missing_evidence(invocation.state(), invocation.hints(), attempt_id)
    )
    return {
        "attempt_id": attempt_id,
        "deadline_at": deadline.isoformat(),
        "classified_as": policy.OutcomeKind.POST_DISPATCH_EVIDENCE_FAILED.value,
    }


def flag_missing_evidence(*, invocation_id: str, now: dt.datetime | None = None) -> bool:
    """Flag the in-flight attempt of an invocation past its deadline with no outcome.

    Returns False when there is nothing to flag (an outcome won the race, or the
    deadline moved): the sweeper may call it for any candidate, any number of times.
    """
    return bool(_flag_missing_evidence([invocation_id], now, must_exist=True))


def flag_missing_evidence_of(
    *, invocation_ids: Sequence[str], now: dt.datetime | None = None
) -> list[str]:
    """`flag_missing_evidence` for many invocations: one read, one write; the ids flagged.

    When many attempts fall due at once (a business system that stopped answering),
    flagging them one by one took two round trips each. If an outcome arrives for one
    of them between the read and the write, the write changes nothing and the unit is
    read again: that invocation is no longer in flight, the others are flagged.
    """
    return _flag_missing_evidence(invocation_ids, now, must_exist=False)


def _flag_missing_evidence(
    invocation_ids: Sequence[str], now: dt.datetime | None, *, must_exist: bool
) -> list[str]:
    now = now or timezone.now()
    changed = invocation_transitions(
        invocation_ids=invocation_ids,
        actor=SWEEPER,
        kind="evidence_missing",
        change=lambda invocation: _flag_if_overdue(invocation, now),
        now=now,
        must_exist=must_exist,
    )
    return [invocation.invocation_id for invocation in changed]
