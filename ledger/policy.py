"""The retry table and state transitions of DESIGN section 4, as pure functions.

No Django here: the services load an invocation into an `InvocationState`, ask this
module what the next state is, and persist what it answers. Every transition either
returns a new state or raises `Refused` with the typed reason the API reports.
`replay` checks a recorded history against the same rules. Standard library only,
and Python 3.11: the offline bundle verifier imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    RECORDED = "recorded"
    IN_FLIGHT = "in_flight"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RETRY_ALLOWED = "retry_allowed"
    RECONCILIATION_REQUIRED = "reconciliation_required"
    RECONCILING = "reconciling"
    ESCALATED = "escalated"
    RESOLUTION_PROPOSED = "resolution_proposed"


class OutcomeKind(StrEnum):
    SUCCEEDED = "succeeded"
    BUSINESS_FAILED = "business_failed"
    PRE_DISPATCH_REJECTED = "pre_dispatch_rejected"
    DISPATCH_NOT_ESTABLISHED = "dispatch_not_established"
    POST_DISPATCH_EVIDENCE_FAILED = "post_dispatch_evidence_failed"


class Effect(StrEnum):
    """What reconciliation found in the business system."""

    PRESENT = "effect_present"
    ABSENT = "effect_absent"


class Flag(StrEnum):
    UNDECLARED = "undeclared"
    APPROVAL_MISSING = "approval_missing"
    EVIDENCE_CONFLICT = "evidence_conflict"
    # Its evidence names a business reference other invocations' evidence names: one
    # effect counted for two intents, or a mistyped reference.
    REFERENCE_SHARED = "reference_shared"
    # One of its attempts was admitted beyond its capability's declared
    # `execution.rate_limit` (`ledger.rate_limits`): the ledger admits it all the same.
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"


# What each flag tells compliance: the API's schema and the console's invocation page
# say it with the flag.
FLAG_MEANINGS: Mapping[Flag, str] = {
    Flag.UNDECLARED: "its capability was not registered at intent time",
    Flag.APPROVAL_MISSING: "its capability required approval and none was sent",
    Flag.EVIDENCE_CONFLICT: (
        "evidence contradicted what was recorded (a second, different outcome for an "
        "attempt, or a late outcome against the invocation's settled state)"
    ),
    Flag.REFERENCE_SHARED: (
        "its evidence names a business reference that other invocations' evidence names"
    ),
    Flag.RATE_LIMIT_EXCEEDED: (
        "an attempt was admitted beyond its capability's declared execution.rate_limit"
    ),
}


class Cause(StrEnum):
    EVIDENCE_MISSING = "evidence_missing"
    EVIDENCE_REPORTED_LOST = "evidence_reported_lost"
    DISPATCH_UNCERTAIN = "dispatch_uncertain"
    BUSINESS_REJECTED = "business_rejected"
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    EVIDENCE_CONFLICT = "evidence_conflict"
    RECONCILED_PRESENT = "reconciled_effect_present"
    RECONCILED_ABSENT = "reconciled_effect_absent"
    NO_PROBE = "no_probe"
    PROBE_INCONCLUSIVE = "probe_inconclusive"
    PROPOSAL_REJECTED = "proposal_rejected"
    # A probe found the effect under a business reference other invocations' evidence
    # names: only a person may count one effect for this intent too.
    REFERENCE_SHARED = "reference_shared"


class NextAction(StrEnum):
    DISPATCH = "dispatch"
    AWAIT_OUTCOME = "await_outcome"
    NONE = "none"
    RETRY = "retry"
    RECONCILE = "reconcile"


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED})
NEEDS_RECONCILIATION = frozenset(
    {
        Status.RECONCILIATION_REQUIRED,
        Status.RECONCILING,
        Status.ESCALATED,
        Status.RESOLUTION_PROPOSED,
    }
)
ADMITS_ATTEMPT = frozenset({Status.RECORDED, Status.RETRY_ALLOWED})

NEXT_ACTION = {
    Status.RECORDED: NextAction.DISPATCH,
    Status.IN_FLIGHT: NextAction.AWAIT_OUTCOME,
    Status.SUCCEEDED: NextAction.NONE,
    Status.FAILED: NextAction.NONE,
    Status.RETRY_ALLOWED: NextAction.RETRY,
    Status.RECONCILIATION_REQUIRED: NextAction.RECONCILE,
    Status.RECONCILING: NextAction.RECONCILE,
    Status.ESCALATED: NextAction.RECONCILE,
    Status.RESOLUTION_PROPOSED: NextAction.RECONCILE,
}


@dataclass(frozen=True)
class Hints:
    """What the capability declaration (snapshotted at intent time) tells the policy."""

    readonly: bool = False
    idempotency_verified: bool = False
    max_attempts: int = 5


CONSERVATIVE_HINTS = Hints(readonly=False, idempotency_verified=False)


@dataclass(frozen=True)
class InvocationState:
    status: Status = Status.RECORDED
    failure_class: OutcomeKind | None = None
    cause: Cause | None = None
    attempts: int = 0
    in_flight_attempt: str | None = None
    # The settled answer of reconciliation, kept so late evidence can be compared.
    resolution: Effect | None = None
    flags: frozenset[Flag] = field(default_factory=frozenset)

    @classmethod
    def parse(
        cls,
        *,
        status: str,
        failure_class: str | None,
        cause: str | None,
        attempts: int,
        in_flight_attempt: str | None,
        resolution: str | None,
        flags: Iterable[str],
    ) -> InvocationState:
        """From stored values, where blank or null means none; ValueError or TypeError
        for a value that is not this module's."""
        if type(attempts) is not int or not isinstance(in_flight_attempt, str | None):
            raise TypeError(f"attempts {attempts!r}, in flight {in_flight_attempt!r}")
        return cls(
            status=Status(status),
            failure_class=OutcomeKind(failure_class) if failure_class else None,
            cause=Cause(cause) if cause else None,
            attempts=attempts,
            in_flight_attempt=in_flight_attempt or None,
            resolution=Effect(resolution) if resolution else None,
            flags=frozenset(Flag(flag) for flag in flags),
        )

    def described(self) -> str:
        """Its fields that are set, for people: `status in_flight, attempts 1, …`."""
        shown = ((f.name, getattr(self, f.name)) for f in fields(self))
        return ", ".join(
            f"{name} {','.join(sorted(value)) if isinstance(value, frozenset) else value}"
            for name, value in shown
            if value or name == "attempts"
        )

    @property
    def retryable(self) -> bool:
        return self.status is Status.RETRY_ALLOWED

    @property
    def reconciliation_required(self) -> bool:
        return self.status in NEEDS_RECONCILIATION

    @property
    def next_action(self) -> NextAction:
        return NEXT_ACTION[self.status]


class Refused(Exception):
    """A transition the policy forbids; `reason` is the API error type."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def admit(state: InvocationState, hints: Hints, attempt_id: str) -> InvocationState:
    """A new transport attempt: only from `recorded` or `retry_allowed`."""
    if state.status is Status.IN_FLIGHT:
        raise Refused(
            "attempt_in_flight",
            f"attempt {state.in_flight_attempt!r} of this invocation is in flight",
        )
    if state.status not in ADMITS_ATTEMPT:
        raise Refused("attempt_refused", _refusal_message(state))
    if state.attempts >= hints.max_attempts:
        raise Refused(
            "attempt_refused", f"the capability allows at most {hints.max_attempts} attempts"
        )
    return replace(
        state,
        status=Status.IN_FLIGHT,
        attempts=state.attempts + 1,
        in_flight_attempt=attempt_id,
        failure_class=None,
        cause=None,
        resolution=None,
    )


def _refusal_message(state: InvocationState) -> str:
    if state.reconciliation_required:
        return (
            "the outcome of an earlier attempt is unknown; the invocation must be "
            "reconciled before any new attempt"
        )
    return f"the invocation is {state.status.value}; no new attempt may be admitted"


def outcome_decision(
    hints: Hints, kind: OutcomeKind, retryable: bool, attempts: int
) -> tuple[Status, OutcomeKind | None, Cause | None]:
    """The retry table: where a reported outcome of the in-flight attempt leads."""
    if kind is OutcomeKind.SUCCEEDED:
        return Status.SUCCEEDED, None, None
    if kind is OutcomeKind.BUSINESS_FAILED and not retryable:
        return Status.FAILED, kind, Cause.BUSINESS_REJECTED
    safe_to_resend = {
        OutcomeKind.PRE_DISPATCH_REJECTED: True,
        OutcomeKind.BUSINESS_FAILED: True,
        OutcomeKind.DISPATCH_NOT_ESTABLISHED: hints.readonly or hints.idempotency_verified,
        OutcomeKind.POST_DISPATCH_EVIDENCE_FAILED: hints.readonly,
    }[kind]
    if not safe_to_resend:
        cause = (
            Cause.DISPATCH_UNCERTAIN
            if kind is OutcomeKind.DISPATCH_NOT_ESTABLISHED
            else Cause.EVIDENCE_REPORTED_LOST
        )
        return Status.RECONCILIATION_REQUIRED, kind, cause
    if attempts >= hints.max_attempts:
        return Status.FAILED, kind, Cause.ATTEMPTS_EXHAUSTED
    return Status.RETRY_ALLOWED, kind, None


def report_outcome(
    state: InvocationState,
    hints: Hints,
    attempt_id: str,
    attempt_number: int,
    kind: OutcomeKind,
    retryable: bool = False,
    *,
    names_another_effect: bool = False,
) -> InvocationState:
    """An outcome from the runtime.

    For the in-flight attempt it applies the retry table. Anything else is late
    evidence: it settles an open reconciliation, agrees with what was settled
    (nothing changes), or contradicts it (escalated, `evidence_conflict`). An
    effect that names another business reference than the settled evidence did
    (`names_another_effect`) contradicts it too: it may be a second effect.
    """
    if state.status is Status.IN_FLIGHT and state.in_flight_attempt == attempt_id:
        status, failure_class, cause = outcome_decision(hints, kind, retryable, state.attempts)
        return replace(
            state,
            status=status,
            failure_class=failure_class,
            cause=cause,
            in_flight_attempt=None,
        )
    return late_outcome(
        state, hints, attempt_number, kind, retryable, names_another_effect=names_another_effect
    )


def late_outcome(
    state: InvocationState,
    hints: Hints,
    attempt_number: int,
    kind: OutcomeKind,
    retryable: bool,
    *,
    names_another_effect: bool = False,
) -> InvocationState:
    implied = implied_effect(kind)
    if attempt_number < state.attempts:
        # A later attempt was admitted only because this one was taken to have had
        # no effect; evidence that it had one means a possible second effect.
        return _conflict(state) if implied is Effect.PRESENT else state
    settled = state.resolution or _effect_of_terminal(state)
    if settled is not None:
        if implied is not None and implied is not settled:
            return _conflict(state)
        if implied is Effect.PRESENT and names_another_effect:
            return _conflict(state)
        return state
    if implied is not None and (
        state.status in NEEDS_RECONCILIATION or state.status is Status.RETRY_ALLOWED
    ):
        # The runtime's own evidence says what happened: it settles the question.
        status, failure_class, cause = outcome_decision(hints, kind, retryable, state.attempts)
        return replace(state, status=status, failure_class=failure_class, cause=cause)
    return state


def implied_effect(kind: OutcomeKind) -> Effect | None:
    """What an outcome says about the business effect; None when it says nothing."""
    if kind is OutcomeKind.SUCCEEDED:
        return Effect.PRESENT
    if kind in (OutcomeKind.BUSINESS_FAILED, OutcomeKind.PRE_DISPATCH_REJECTED):
        return Effect.ABSENT
    return None


def _effect_of_terminal(state: InvocationState) -> Effect | None:
    if state.status is Status.SUCCEEDED:
        return Effect.PRESENT
    if state.status is Status.FAILED and state.cause is Cause.BUSINESS_REJECTED:
        return Effect.ABSENT
    return None


def _conflict(state: InvocationState) -> InvocationState:
    return replace(
        state,
        status=Status.ESCALATED,
        cause=Cause.EVIDENCE_CONFLICT,
        in_flight_attempt=None,
        flags=state.flags | {Flag.EVIDENCE_CONFLICT},
    )


def flag_missing_evidence(state: InvocationState, hints: Hints, attempt_id: str) -> InvocationState:
    """The in-flight attempt passed its deadline with no outcome (the sweeper's call)."""
    if state.status is not Status.IN_FLIGHT or state.in_flight_attempt != attempt_id:
        raise Refused("not_in_flight", f"attempt {attempt_id!r} is not in flight")
    status, failure_class, _ = outcome_decision(
        hints, OutcomeKind.POST_DISPATCH_EVIDENCE_FAILED, False, state.attempts
    )
    return replace(
        state,
        status=status,
        failure_class=failure_class,
        cause=Cause.EVIDENCE_MISSING,
        in_flight_attempt=None,
    )


def resolve(state: InvocationState, hints: Hints, effect: Effect) -> InvocationState:
    """Reconciliation's answer, from a probe or an operator."""
    if state.status not in NEEDS_RECONCILIATION:
        raise Refused(
            "not_reconcilable", f"the invocation is {state.status.value}; nothing to resolve"
        )
    if effect is Effect.PRESENT:
        return replace(
            state,
            status=Status.SUCCEEDED,
            cause=Cause.RECONCILED_PRESENT,
            resolution=effect,
        )
    if state.attempts >= hints.max_attempts:
        return replace(
            state, status=Status.FAILED, cause=Cause.ATTEMPTS_EXHAUSTED, resolution=effect
        )
    return replace(
        state, status=Status.RETRY_ALLOWED, cause=Cause.RECONCILED_ABSENT, resolution=effect
    )


# Reconciliation's own transitions ---------------------------------------------

CLAIMABLE = frozenset({Status.RECONCILIATION_REQUIRED, Status.ESCALATED})


def claim(state: InvocationState) -> InvocationState:
    """A probe takes the invocation (with a lease the caller records)."""
    if state.status not in CLAIMABLE:
        raise Refused("not_claimable", f"the invocation is {state.status.value}")
    return replace(state, status=Status.RECONCILING)


def release(state: InvocationState) -> InvocationState:
    """The probe gave no answer (or its lease expired): the question stays open."""
    if state.status is not Status.RECONCILING:
        raise Refused("not_reconciling", f"the invocation is {state.status.value}")
    return replace(state, status=Status.RECONCILIATION_REQUIRED)


def with_flag(state: InvocationState, flag: Flag) -> InvocationState:
    """The same state, with something more for compliance to see."""
    return replace(state, flags=state.flags | {flag})


def escalate(state: InvocationState, cause: Cause) -> InvocationState:
    """Hand the invocation to a person."""
    if state.status not in (Status.RECONCILING, Status.RECONCILIATION_REQUIRED):
        raise Refused("not_reconcilable", f"the invocation is {state.status.value}")
    return replace(state, status=Status.ESCALATED, cause=cause)


def propose(state: InvocationState) -> InvocationState:
    """A person's resolution of a high-risk invocation waits for a second person."""
    if state.status not in NEEDS_RECONCILIATION or state.status is Status.RESOLUTION_PROPOSED:
        raise Refused("not_reconcilable", f"the invocation is {state.status.value}")
    return replace(state, status=Status.RESOLUTION_PROPOSED)


def reject_proposal(state: InvocationState) -> InvocationState:
    if state.status is not Status.RESOLUTION_PROPOSED:
        raise Refused("no_proposal", "there is no proposal to reject")
    return replace(state, status=Status.ESCALATED, cause=Cause.PROPOSAL_REJECTED)


# Replaying a recorded history ---------------------------------------------------

# What each event records of its invocation's state (services._state_summary), a blank
# column recorded as null, and what an intent records of its capability's hints.
RECORDED_STATE = (
    "status",
    "failure_class",
    "cause",
    "resolution",
    "flags",
    "attempt_count",
    "in_flight_attempt",
)
BLANK_AS_NULL = frozenset({"failure_class", "cause", "resolution", "in_flight_attempt"})
RECORDED_HINTS = ("readonly", "idempotency_verified", "max_attempts")

# The flags a service sets beside a rule, by the kind of event that records them:
# what the capability lacked at the intent, a claim contradicting the recorded
# outcome, a business reference other invocations' evidence names (or, found later by
# the reference watch, names too), an attempt admitted beyond the capability's
# declared rate. Any other event
# adding a flag no rule adds is a history no service wrote.
FLAGS_BESIDE_A_RULE: Mapping[str, frozenset[Flag]] = {
    "intent_recorded": frozenset({Flag.UNDECLARED, Flag.APPROVAL_MISSING}),
    "outcome_conflict": frozenset({Flag.EVIDENCE_CONFLICT}),
    "outcome_recorded": frozenset({Flag.REFERENCE_SHARED}),
    "late_outcome_recorded": frozenset({Flag.REFERENCE_SHARED}),
    "probe_run": frozenset({Flag.REFERENCE_SHARED}),
    "resolution": frozenset({Flag.REFERENCE_SHARED}),
    "resolution_approved": frozenset({Flag.REFERENCE_SHARED}),
    "rate_limit_exceeded": frozenset({Flag.RATE_LIMIT_EXCEEDED}),
    "reference_shared": frozenset({Flag.REFERENCE_SHARED}),
}


@dataclass(frozen=True)
class Unexplained:
    """The first recorded state a replay finds no rule leading to."""

    seq: int
    expected: str
    found: str


def replay(events: Iterable[tuple[int, str, Mapping[str, Any]]]) -> Unexplained | None:
    """Replay one invocation's events (seq, kind, data), from its intent: the first
    recorded state no rule leads to from the one before, or None.

    Hashes show what was changed after it was written; this shows a history no
    service could have written, hashes and all: rewritten and re-hashed by hand, or
    written by a faulty service. Events from before the whole state was recorded are
    not replayed. Standard library only: the offline bundle verifier replays too.
    """
    hints: Hints | None = None
    before = InvocationState()
    for seq, kind, data in events:
        if hints is None:
            recorded_hints = data.get("hints")
            if not isinstance(recorded_hints, Mapping) or any(
                name not in recorded_hints for name in RECORDED_HINTS
            ):
                return None
            hints = Hints(**{name: recorded_hints[name] for name in RECORDED_HINTS})
            if not (
                isinstance(hints.readonly, bool)
                and isinstance(hints.idempotency_verified, bool)
                and type(hints.max_attempts) is int
            ):
                return Unexplained(seq, "hints of a capability", repr(dict(recorded_hints)))
        recorded = data.get("state")
        if not isinstance(recorded, Mapping) or any(n not in recorded for n in RECORDED_STATE):
            return None
        try:
            after = InvocationState.parse(
                attempts=recorded["attempt_count"],
                **{name: recorded[name] for name in RECORDED_STATE if name != "attempt_count"},
            )
        except (ValueError, TypeError):
            return Unexplained(seq, "a state of the retry policy", repr(dict(recorded)))
        if not explains(before, after, hints, FLAGS_BESIDE_A_RULE.get(kind, frozenset())):
            return Unexplained(
                seq,
                f"a step of the retry policy from {before.described()}",
                f"{kind} recording {after.described()}",
            )
        before = after
    return None


# In the states compared below, the attempt in flight before the step and one newly
# admitted by it: ids are the runtime's, and only whether they changed matters here.
IN_FLIGHT_BEFORE = "(in flight before)"
ADMITTED_NOW = "(admitted now)"


def explains(
    before: InvocationState,
    after: InvocationState,
    hints: Hints,
    beside: frozenset[Flag] = frozenset(),
) -> bool:
    """Whether one rule of this module, with only flags of `beside` added beside it,
    leads from `before` to `after`: what `verify_ledger` asks of every pair of
    consecutive recorded states, so that a history no service could have written is
    found even where every hash checks out."""
    previous = before.in_flight_attempt
    if previous:
        before = replace(before, in_flight_attempt=IN_FLIGHT_BEFORE)
    now = after.in_flight_attempt
    in_flight = now and (IN_FLIGHT_BEFORE if now == previous else ADMITTED_NOW)
    flags_added_by = _steps(before, hints).get(_unflagged(after, in_flight), ())
    return any(flags <= after.flags <= flags | beside for flags in flags_added_by)


# (An assignment, not a `type` statement: the offline verifier imports this module,
# and Python 3.11, which Debian 12 ships, has no `type` statement.)
Unflagged = tuple[object, ...]


def _unflagged(state: InvocationState, in_flight_attempt: str | None) -> Unflagged:
    return (
        state.status,
        state.failure_class,
        state.cause,
        state.attempts,
        in_flight_attempt,
        state.resolution,
    )


@functools.lru_cache(maxsize=4096)
def _steps(state: InvocationState, hints: Hints) -> dict[Unflagged, list[frozenset[Flag]]]:
    """Every state one rule leads to from `state` (itself included: an event may record
    no change), for every argument the rule may be given: keyed without flags, with the
    flags each way there leaves set. Histories repeat a handful of states, hence the
    cache."""
    found = {state}

    def step(rule: Callable[..., InvocationState], *args: object, **kwargs: object) -> None:
        with contextlib.suppress(Refused):
            found.add(rule(state, *args, **kwargs))

    step(admit, hints, ADMITTED_NOW)
    for kind, retryable in itertools.product(OutcomeKind, (False, True)):
        if state.in_flight_attempt:
            step(report_outcome, hints, state.in_flight_attempt, state.attempts, kind, retryable)
        for number, another in itertools.product(range(1, state.attempts + 1), (False, True)):
            step(late_outcome, hints, number, kind, retryable, names_another_effect=another)
    if state.in_flight_attempt:
        step(flag_missing_evidence, hints, state.in_flight_attempt)
    for effect in Effect:
        step(resolve, hints, effect)
    for cause in Cause:
        step(escalate, cause)
    for rule in (claim, release, propose, reject_proposal):
        step(rule)
    steps: dict[Unflagged, list[frozenset[Flag]]] = {}
    for reached in found:
        unflagged = _unflagged(reached, reached.in_flight_attempt)
        steps.setdefault(unflagged, []).append(reached.flags)
    return steps
