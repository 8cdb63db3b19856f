"""Settling unknown outcomes: claims with leases, probe results, human resolutions.

Every function here changes one invocation through
`ledger.services.invocation_transition`: a compare-and-set write that appends the
event explaining the change, so two workers (or a worker and an operator) can never
both settle the same invocation.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import DatabaseError, OperationalError, connection, transaction
from django.utils import timezone

from ledger import policy
from ledger.audit import invocations_naming
from ledger.models import (
    LEASE_EXPIRED,
    PROBE_COULD_SETTLE,
    PROBE_WORKER_LOST,
    Capability,
    Invocation,
)
from ledger.services import (
    LedgerError,
    invocation_transition,
    invocation_transitions,
    shared_reference_data,
)
from reconciliation import probes
from reconciliation.probes import Finding, ProbeResult

log = logging.getLogger(__name__)

FINDING_EFFECT = {Finding.PRESENT: policy.Effect.PRESENT, Finding.ABSENT: policy.Effect.ABSENT}
# How many of the other invocations naming a reference a refusal and an event list.
SHARED_NAMED_LIMIT = 10


def _refused(refused: policy.Refused) -> LedgerError:
    return LedgerError(refused.reason, refused.message, status=409)


def _not_stale(invocation: Invocation, seen_event_count: int | None) -> None:
    """A person acted on a page that no longer shows the invocation as it is."""
    if seen_event_count is not None and invocation.event_count != seen_event_count:
        raise LedgerError(
            "stale",
            "The invocation changed since this page was loaded; nothing was applied. "
            "Look at it again.",
            status=409,
        )


def probe_requested(*, invocation_id: str, actor: str, queued: bool) -> None:
    """An operator asked for the probe to run now, and whether the broker took the
    job: recorded, state unchanged."""
    invocation_transition(
        invocation_id=invocation_id,
        actor=actor,
        kind="probe_requested",
        change=lambda invocation: {"status": invocation.status, "queued": queued},
    )


def probes_requested(
    *, capability: Capability, invocation_ids: Sequence[str], actor: str
) -> list[str]:
    """An operator asked for the probe of every invocation of a capability it could
    settle: recorded on each that still waits for it, state unchanged; returns those."""

    def change(invocation: Invocation) -> dict[str, Any] | None:
        waits = invocation.status == policy.Status.ESCALATED and not invocation.assignee
        if not waits or invocation.cause not in PROBE_COULD_SETTLE:
            return None
        return {"status": invocation.status, "queued": True, "every_of": capability.scope}

    requested = invocation_transitions(
        invocation_ids=invocation_ids, actor=actor, kind="probe_requested", change=change
    )
    return [invocation.invocation_id for invocation in requested]


def invocation_assign(
    *, invocation_id: str, actor: str, take: bool, seen_event_count: int | None = None
) -> Invocation | None:
    """An operator takes ("I'm on it") or gives back a flagged invocation."""
    user = actor.removeprefix("user:")

    def change(invocation: Invocation) -> dict[str, Any] | None:
        _not_stale(invocation, seen_event_count)
        if take:
            if invocation.assignee and invocation.assignee != user:
                raise LedgerError("assigned", f"{invocation.assignee} is already on it", status=409)
            if invocation.assignee == user:
                return None
            invocation.assignee = user
        else:
            if invocation.assignee != user:
                return None
            invocation.assignee = ""
        return {"assignee": invocation.assignee or None}

    return invocation_transition(
        invocation_id=invocation_id,
        actor=actor,
        kind="assigned" if take else "unassigned",
        change=change,
    )


def invocation_claim(
    *, invocation_id: str, worker: str, now: dt.datetime | None = None, force: bool = False
) -> Invocation | None:
    """Take a flagged invocation for probing, with a lease; None if not claimable now.

    `force` (an operator's "re-run probe now") also claims escalated invocations and
    ignores the backoff.
    """
    now = now or timezone.now()

    def change(invocation: Invocation) -> dict[str, Any] | None:
        status = policy.Status(invocation.status)
        if status is policy.Status.ESCALATED and not force:
            return None
        if not force and invocation.next_probe_at and invocation.next_probe_at > now:
            return None
        try:
            invocation.apply_state(policy.claim(invocation.state()))
        except policy.Refused:
            return None
        invocation.lease_owner = worker
        invocation.lease_expires_at = now + probe_lease(invocation)
        return {"worker": worker, "lease_expires_at": invocation.lease_expires_at.isoformat()}

    return invocation_transition(
        invocation_id=invocation_id,
        actor=f"ledger:{worker}",
        kind="reconciliation_claimed",
        change=change,
        now=now,
    )


def probe_lease(invocation: Invocation) -> dt.timedelta:
    """LEDGER_PROBE_LEASE_SECONDS, or longer for a probe that may take longer (an http
    probe's timeouts, a python probe's declared one): a lease running out under a probe
    still waiting for its answer would send a second probe beside it, and count a hung
    worker where there was none."""
    capability = invocation.probed_by()
    longest = probes.longest_run(capability.probe) if capability else 0.0
    return dt.timedelta(seconds=max(settings.LEDGER_PROBE_LEASE_SECONDS, longest))


def _clear_lease(invocation: Invocation) -> None:
    invocation.lease_owner = ""
    invocation.lease_expires_at = None


def record_probe_result(
    *, invocation_id: str, worker: str, result: ProbeResult | None, now: dt.datetime | None = None
) -> Invocation | None:
    """Settle, retry later, or escalate, from what the probe found.

    A result from a worker whose lease was lost (expired and taken over, or the
    runtime's late outcome settled the invocation meanwhile) is not applied.
    """
    now = now or timezone.now()

    def change(invocation: Invocation) -> dict[str, Any] | None:
        if invocation.status != policy.Status.RECONCILING or invocation.lease_owner != worker:
            return None
        data: dict[str, Any] = {"worker": worker}
        state = invocation.state()
        _clear_lease(invocation)
        if result is None:
            invocation.apply_state(policy.escalate(state, policy.Cause.NO_PROBE))
            data["finding"] = None
            return data
        data.update(
            finding=result.finding.value,
            business_reference=result.business_reference or None,
            detail=result.detail or None,
            request=result.summary,
            duration_ms=result.duration_ms,
            try_number=invocation.probe_tries + 1,
        )
        if result.finding in FINDING_EFFECT:
            invocation.next_probe_at = None
            found_under = result.business_reference if result.finding is Finding.PRESENT else ""
            others = _others_naming(invocation, found_under)
            if others:
                shared = _counted_as_shared(invocation, state, data, others)
                invocation.apply_state(policy.escalate(shared, policy.Cause.REFERENCE_SHARED))
                return data
            invocation.apply_state(
                policy.resolve(state, invocation.hints(), FINDING_EFFECT[result.finding])
            )
            return data
        invocation.probe_tries += 1
        if invocation.probe_tries >= settings.LEDGER_PROBE_MAX_TRIES:
            invocation.apply_state(policy.escalate(state, policy.Cause.PROBE_INCONCLUSIVE))
            invocation.next_probe_at = None
            return data
        backoff = settings.LEDGER_PROBE_BACKOFF_SECONDS * 2 ** (invocation.probe_tries - 1)
        if result.retry_after > backoff:
            backoff = result.retry_after
            data["retry_after"] = result.retry_after
        invocation.apply_state(policy.release(state))
        invocation.next_probe_at = now + dt.timedelta(seconds=backoff)
        data["next_probe_at"] = invocation.next_probe_at.isoformat()
        return data

    return invocation_transition(
        invocation_id=invocation_id,
        actor=f"ledger:{worker}",
        kind="probe_run",
        change=change,
        now=now,
    )


def _others_naming(invocation: Invocation, reference: str) -> dict[str, int]:
    """The other invocations whose evidence names the reference an effect was found
    under, with their runtimes. One effect is never counted for two intents unasked: a
    person must confirm it, and a probe, which cannot be asked, hands the invocation to
    a person."""
    if not reference:
        return {}
    others = invocations_naming(
        reference, besides=invocation.invocation_id, limit=SHARED_NAMED_LIMIT
    )
    return {other.invocation_id: other.runtime_id for other in others}


def _counted_as_shared(
    invocation: Invocation,
    state: policy.InvocationState,
    data: dict[str, Any],
    others: dict[str, int],
) -> policy.InvocationState:
    """The event's data records the other invocations naming the reference (as a
    runtime may read them), and the state is flagged for compliance."""
    data.update(shared_reference_data(others, invocation.runtime_id))
    return policy.with_flag(state, policy.Flag.REFERENCE_SHARED)


def expire_lease(*, invocation_id: str, now: dt.datetime | None = None) -> bool:
    """Reopen an invocation whose probe worker died or hangs (its lease ran out)."""
    now = now or timezone.now()
    return _reopen_claim(
        invocation_id=invocation_id,
        kind=LEASE_EXPIRED,
        when=lambda expires, invocation: expires <= now,
        lease_key="lease_expired_at",
        now=now,
    )


def release_lost_claim(*, invocation_id: str, now: dt.datetime | None = None) -> bool:
    """Reopen an invocation whose probe worker is gone before its lease runs out.

    The lock is looked at after the claim is read: a worker still probing took it
    before its claim was written and lets go only after its result was, and a result
    written meanwhile makes this compare-and-set load the invocation again."""
    return _reopen_claim(
        invocation_id=invocation_id,
        kind=PROBE_WORKER_LOST,
        when=lambda expires, invocation: bool(without_probe_lock([invocation.invocation_id])),
        lease_key="lease_expires_at",
        now=now,
    )


def _reopen_claim(
    *,
    invocation_id: str,
    kind: str,
    when: Callable[[dt.datetime, Invocation], bool],
    lease_key: str,
    now: dt.datetime | None,
) -> bool:
    """Release a probe's claim `when` its lease's end and the invocation say so, with
    the event `kind` naming the worker that held it."""

    def change(invocation: Invocation) -> dict[str, Any] | None:
        expires = invocation.lease_expires_at
        if invocation.status != policy.Status.RECONCILING or expires is None:
            return None
        if not when(expires, invocation):
            return None
        owner = invocation.lease_owner
        invocation.apply_state(policy.release(invocation.state()))
        _clear_lease(invocation)
        return {"worker": owner, lease_key: expires.isoformat()}

    changed = invocation_transition(
        invocation_id=invocation_id, actor="ledger:sweeper", kind=kind, change=change, now=now
    )
    return changed is not None


# The advisory locks a probe worker holds on its database session, one per invocation
# (two-key form, so no one-key lock of the ledger's can collide with them).
PROBE_LOCKS = "ledger.probe"

# How long a job waits for a probe lock another session holds: longer than a claim's
# transaction, which a job holding the lock may be in, and short, as a job that holds
# it longer has claimed and probes, and this job's claim would find it claimed.
PROBE_LOCK_WAIT = "2s"


@contextmanager
def probe_lock(invocation_id: str) -> Iterator[None]:
    """Hold the invocation's probe lock on this worker's database session from before
    its claim until after its result is recorded.

    PostgreSQL lets go of a session's locks when the session ends, however its process
    died, so a claim whose lock no session holds is a lost worker's:
    `release_lost_claim` reopens it without waiting for its lease. The lock is a
    shortcut, never a guard: a job that cannot take it within PROBE_LOCK_WAIT (a
    session that no longer probes holds it, behind a transaction-mode pooler say, or
    two ids share a hash) claims as before, and the worst a claim released early does
    is have one more read-only probe asked, whose result its compare-and-set drops."""
    held = _take_probe_lock(invocation_id)
    try:
        yield
    finally:
        if held:
            _let_go_of_probe_lock(invocation_id)


def _take_probe_lock(invocation_id: str) -> bool:
    try:
        # (Its own transaction for the wait, which SET LOCAL ends with it; the lock,
        # a session's, outlives it.)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [PROBE_LOCK_WAIT])
            cursor.execute(
                "SELECT pg_advisory_lock(hashtext(%s), hashtext(%s))",
                [PROBE_LOCKS, invocation_id],
            )
        return True
    except OperationalError as exc:
        log.info("probe lock held elsewhere invocation=%s error=%s", invocation_id, exc)
        return False


def _let_go_of_probe_lock(invocation_id: str) -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_unlock(hashtext(%s), hashtext(%s))",
                [PROBE_LOCKS, invocation_id],
            )
    except DatabaseError as exc:
        # A session that cannot run this is gone or going, and its locks with it.
        log.warning("probe lock not released invocation=%s error=%s", invocation_id, exc)


def without_probe_lock(invocation_ids: Collection[str]) -> set[str]:
    """Those of the invocations whose probe lock no database session holds."""
    if not invocation_ids:
        return set()
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT id FROM unnest(%s::text[]) AS id
            WHERE NOT EXISTS (
                SELECT FROM pg_locks
                WHERE locktype = 'advisory' AND granted AND objsubid = 2
                  AND classid = hashtext(%s)::oid AND objid = hashtext(id)::oid
            )
            """,
            [list(invocation_ids), PROBE_LOCKS],
        )
        return {invocation_id for (invocation_id,) in cursor.fetchall()}


class SharedReference(LedgerError):
    """The business reference is named by other invocations' evidence already."""

    def __init__(self, reference: str, also_named_by: list[str]) -> None:
        super().__init__(
            "business_reference_shared",
            "other invocations' evidence names this business reference",
            details={"business_reference": reference, "also_named_by": also_named_by},
        )
        self.reference = reference
        self.also_named_by = also_named_by


def invocation_resolve(
    *,
    invocation_id: str,
    actor: str,
    effect: policy.Effect,
    business_reference: str = "",
    note: str,
    seen_event_count: int | None = None,
    shared_reference_confirmed: bool = False,
) -> Invocation:
    """A person's resolution. High-risk invocations only get a proposal, which a
    second, different person must approve (invocation_approve).

    An effect whose business reference other invocations' evidence names already
    would count one effect for two intents: it is refused (SharedReference) unless
    the person confirmed the reference, and then the event names those invocations.
    """
    if not note.strip():
        raise LedgerError("validation_failed", "a note is required", status=400)
    if effect is policy.Effect.PRESENT and not business_reference.strip():
        raise LedgerError(
            "validation_failed",
            "an effect that happened needs its business reference",
            status=400,
        )

    def change(invocation: Invocation) -> dict[str, Any] | None:
        _not_stale(invocation, seen_event_count)
        state = invocation.state()
        data: dict[str, Any] = {
            "effect": effect.value,
            "business_reference": business_reference,
            "note": note,
        }
        if effect is policy.Effect.PRESENT:
            others = _others_naming(invocation, business_reference)
            if others and not shared_reference_confirmed:
                raise SharedReference(business_reference, sorted(others))
            if others:
                state = _counted_as_shared(invocation, state, data, others)
        try:
            if invocation.risk_level == "high":
                invocation.apply_state(policy.propose(state))
                invocation.proposal = {**data, "proposed_by": actor}
                return {**data, "proposal": True}
            invocation.apply_state(policy.resolve(state, invocation.hints(), effect))
        except policy.Refused as refused:
            raise _refused(refused) from None
        _clear_lease(invocation)
        return data

    changed = invocation_transition(
        invocation_id=invocation_id, actor=actor, kind="resolution", change=change
    )
    assert changed is not None
    return changed


def invocation_approve(
    *,
    invocation_id: str,
    actor: str,
    note: str = "",
    seen_event_count: int | None = None,
    shared_reference_confirmed: bool = False,
) -> Invocation:
    """The second person confirms a proposed resolution.

    If, since the proposal, other invocations' evidence has come to name its business
    reference, the approver is asked to confirm it as the proposer would have been
    (SharedReference): they are the person who counts the effect.
    """

    def change(invocation: Invocation) -> dict[str, Any] | None:
        _not_stale(invocation, seen_event_count)
        proposal = invocation.proposal
        if invocation.status != policy.Status.RESOLUTION_PROPOSED or not proposal:
            raise LedgerError("no_proposal", "there is no proposal to approve", status=409)
        if proposal["proposed_by"] == actor:
            raise LedgerError(
                "same_person",
                "a proposal is approved by someone other than its author",
                status=403,
            )
        effect = policy.Effect(proposal["effect"])
        state = invocation.state()
        data = {**proposal, "approved_by": actor, "approval_note": note}
        if effect is policy.Effect.PRESENT:
            reference = proposal.get("business_reference", "")
            others = _others_naming(invocation, reference)
            unconfirmed = _named_since(proposal, others, invocation.runtime_id)
            if unconfirmed and not shared_reference_confirmed:
                raise SharedReference(reference, unconfirmed)
            data.pop("also_named_by", None)
            data.pop("also_named_elsewhere", None)
            if others:
                state = _counted_as_shared(invocation, state, data, others)
        invocation.apply_state(policy.resolve(state, invocation.hints(), effect))
        invocation.proposal = None
        _clear_lease(invocation)
        return data

    changed = invocation_transition(
        invocation_id=invocation_id, actor=actor, kind="resolution_approved", change=change
    )
    assert changed is not None
    return changed


def _named_since(proposal: dict[str, Any], others: dict[str, int], runtime_id: int) -> list[str]:
    """The invocations naming the proposal's reference now that its proposer was not
    asked about. The proposal recorded its own runtime's by id and the others by
    number; naming only ever grows, so more of those means new ones (all listed)."""
    seen = set(proposal.get("also_named_by", []))
    unseen = {other: runtime for other, runtime in others.items() if other not in seen}
    own = [other for other, runtime in unseen.items() if runtime == runtime_id]
    elsewhere = [other for other, runtime in unseen.items() if runtime != runtime_id]
    if len(elsewhere) <= proposal.get("also_named_elsewhere", 0):
        elsewhere = []
    return sorted(own + elsewhere)


def invocation_reject(
    *, invocation_id: str, actor: str, note: str, seen_event_count: int | None = None
) -> Invocation:
    def change(invocation: Invocation) -> dict[str, Any] | None:
        _not_stale(invocation, seen_event_count)
        proposal = invocation.proposal
        try:
            invocation.apply_state(policy.reject_proposal(invocation.state()))
        except policy.Refused as refused:
            raise _refused(refused) from None
        invocation.proposal = None
        return {"rejected": proposal, "note": note}

    changed = invocation_transition(
        invocation_id=invocation_id, actor=actor, kind="resolution_rejected", change=change
    )
    assert changed is not None
    return changed


# How long a person at the console waits for a python probe's answer.
PROBE_TRY_WAIT_SECONDS = 30.0


def probe_tried(capability: Capability, idempotency_key: str, actor: str) -> ProbeResult | None:
    """What the capability's probe finds for a key, as a reconciliation would ask it,
    recording nothing: no invocation is claimed or settled (the probe asks about an
    unsaved one, which has its capability and key alone). Who asked the business
    system about which key is logged.

    None when the capability has no probe; probes.ProbeConfigError for one that cannot
    run as configured."""
    unrecorded = Invocation(capability_scope=capability.scope, idempotency_key=idempotency_key)
    tried: ProbeResult | None = None
    try:
        tried = probes.run(capability.probe, unrecorded, python_wait=PROBE_TRY_WAIT_SECONDS)
    finally:
        log.info(
            "probe tried capability=%s key=%r by=%s finding=%s",
            capability.scope, idempotency_key, actor, tried.finding if tried else "misconfigured",
        )  # fmt: skip
    return tried
