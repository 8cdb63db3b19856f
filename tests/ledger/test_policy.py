"""The retry table of DESIGN section 4, exhaustively, and its invariants under any
sequence of events (Hypothesis state machine). No database."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ledger.policy import (
    FLAGS_BESIDE_A_RULE,
    NEEDS_RECONCILIATION,
    TERMINAL,
    Cause,
    Effect,
    Flag,
    Hints,
    InvocationState,
    NextAction,
    OutcomeKind,
    Refused,
    Status,
    admit,
    claim,
    escalate,
    explains,
    flag_missing_evidence,
    propose,
    reject_proposal,
    release,
    report_outcome,
    resolve,
)

ALL_HINTS = [
    Hints(readonly=readonly, idempotency_verified=verified, max_attempts=5)
    for readonly, verified in itertools.product([False, True], repeat=2)
]


def expected_after_outcome(hints: Hints, kind: OutcomeKind, retryable: bool) -> Status:
    """DESIGN section 4's table, written out row by row."""
    match kind:
        case OutcomeKind.SUCCEEDED:
            return Status.SUCCEEDED
        case OutcomeKind.PRE_DISPATCH_REJECTED:
            return Status.RETRY_ALLOWED
        case OutcomeKind.DISPATCH_NOT_ESTABLISHED:
            if hints.readonly or hints.idempotency_verified:
                return Status.RETRY_ALLOWED
            return Status.RECONCILIATION_REQUIRED
        case OutcomeKind.BUSINESS_FAILED:
            return Status.RETRY_ALLOWED if retryable else Status.FAILED
        case OutcomeKind.POST_DISPATCH_EVIDENCE_FAILED:
            return Status.RETRY_ALLOWED if hints.readonly else Status.RECONCILIATION_REQUIRED


@pytest.mark.parametrize("hints", ALL_HINTS, ids=repr)
@pytest.mark.parametrize("kind", list(OutcomeKind))
@pytest.mark.parametrize("retryable", [False, True])
def test_it_applies_the_retry_table_to_every_outcome(
    hints: Hints, kind: OutcomeKind, retryable: bool
) -> None:
    in_flight = admit(InvocationState(), hints, "a1")
    after = report_outcome(in_flight, hints, "a1", 1, kind, retryable)
    expected = expected_after_outcome(hints, kind, retryable)
    assert after.status is expected
    assert after.in_flight_attempt is None
    assert after.retryable is (expected is Status.RETRY_ALLOWED)
    assert after.reconciliation_required is (expected is Status.RECONCILIATION_REQUIRED)
    if expected is Status.RETRY_ALLOWED:
        assert admit(after, hints, "a2").status is Status.IN_FLIGHT
    else:
        with pytest.raises(Refused) as refused:
            admit(after, hints, "a2")
        assert refused.value.reason == "attempt_refused"


@pytest.mark.parametrize("hints", ALL_HINTS, ids=repr)
def test_it_classifies_a_missed_deadline_as_post_dispatch_evidence_failed(hints: Hints) -> None:
    state = flag_missing_evidence(admit(InvocationState(), hints, "a1"), hints, "a1")
    assert state.failure_class is OutcomeKind.POST_DISPATCH_EVIDENCE_FAILED
    assert state.cause is Cause.EVIDENCE_MISSING
    expected = Status.RETRY_ALLOWED if hints.readonly else Status.RECONCILIATION_REQUIRED
    assert state.status is expected


@pytest.mark.parametrize("status", list(Status))
def test_it_admits_attempts_only_when_recorded_or_retry_allowed(status: Status) -> None:
    in_flight = "a0" if status is Status.IN_FLIGHT else None
    state = InvocationState(status=status, attempts=1, in_flight_attempt=in_flight)
    if status in (Status.RECORDED, Status.RETRY_ALLOWED):
        assert admit(state, Hints(), "a1").in_flight_attempt == "a1"
        return
    with pytest.raises(Refused) as refused:
        admit(state, Hints(), "a1")
    expected = "attempt_in_flight" if status is Status.IN_FLIGHT else "attempt_refused"
    assert refused.value.reason == expected


@pytest.mark.parametrize("status", list(Status))
def test_it_derives_next_action_and_flags_from_status(status: Status) -> None:
    state = InvocationState(status=status)
    expected = {
        Status.RECORDED: NextAction.DISPATCH,
        Status.IN_FLIGHT: NextAction.AWAIT_OUTCOME,
        Status.SUCCEEDED: NextAction.NONE,
        Status.FAILED: NextAction.NONE,
        Status.RETRY_ALLOWED: NextAction.RETRY,
    }.get(status, NextAction.RECONCILE)
    assert state.next_action is expected
    assert state.reconciliation_required is (expected is NextAction.RECONCILE)


def test_it_fails_the_invocation_when_attempts_are_exhausted() -> None:
    hints = Hints(readonly=True, max_attempts=2)
    state = InvocationState()
    for number in (1, 2):
        state = admit(state, hints, f"a{number}")
        state = report_outcome(
            state, hints, f"a{number}", number, OutcomeKind.PRE_DISPATCH_REJECTED
        )
    assert state.status is Status.FAILED
    assert state.cause is Cause.ATTEMPTS_EXHAUSTED
    with pytest.raises(Refused):
        admit(state, hints, "a3")


@pytest.mark.parametrize("effect", list(Effect))
def test_it_resolves_reconciliation_to_succeeded_or_retry_under_the_same_key(
    effect: Effect,
) -> None:
    hints = Hints()
    flagged = flag_missing_evidence(admit(InvocationState(), hints, "a1"), hints, "a1")
    resolved = resolve(flagged, hints, effect)
    if effect is Effect.PRESENT:
        assert resolved.status is Status.SUCCEEDED
    else:
        assert resolved.status is Status.RETRY_ALLOWED
        assert admit(resolved, hints, "a2").attempts == 2


@pytest.mark.parametrize("status", sorted(set(Status) - NEEDS_RECONCILIATION))
def test_it_refuses_to_resolve_what_needs_no_reconciliation(status: Status) -> None:
    with pytest.raises(Refused):
        resolve(InvocationState(status=status), Hints(), Effect.PRESENT)


def test_a_late_outcome_that_agrees_completes_the_evidence() -> None:
    hints = Hints()
    flagged = flag_missing_evidence(admit(InvocationState(), hints, "a1"), hints, "a1")
    resolved = resolve(flagged, hints, Effect.PRESENT)
    late = report_outcome(resolved, hints, "a1", 1, OutcomeKind.SUCCEEDED)
    assert late == resolved


def test_a_late_success_naming_another_effect_than_the_resolution_escalates() -> None:
    hints = Hints()
    flagged = flag_missing_evidence(admit(InvocationState(), hints, "a1"), hints, "a1")
    resolved = resolve(flagged, hints, Effect.PRESENT)
    late = report_outcome(
        resolved, hints, "a1", 1, OutcomeKind.SUCCEEDED, names_another_effect=True
    )
    assert (late.status, late.cause) == (Status.ESCALATED, Cause.EVIDENCE_CONFLICT)
    # Before anything was settled, the runtime's own evidence settles it, as always.
    assert (
        report_outcome(
            flagged, hints, "a1", 1, OutcomeKind.SUCCEEDED, names_another_effect=True
        ).status
        is Status.SUCCEEDED
    )


def test_a_late_outcome_settles_an_open_reconciliation() -> None:
    hints = Hints()
    flagged = flag_missing_evidence(admit(InvocationState(), hints, "a1"), hints, "a1")
    late = report_outcome(flagged, hints, "a1", 1, OutcomeKind.SUCCEEDED)
    assert late.status is Status.SUCCEEDED


def test_a_late_outcome_that_contradicts_a_resolution_escalates() -> None:
    hints = Hints()
    flagged = flag_missing_evidence(admit(InvocationState(), hints, "a1"), hints, "a1")
    absent = resolve(flagged, hints, Effect.ABSENT)
    retried = report_outcome(admit(absent, hints, "a2"), hints, "a2", 2, OutcomeKind.SUCCEEDED)
    # The first attempt did have an effect after all: two refunds may exist.
    late = report_outcome(retried, hints, "a1", 1, OutcomeKind.SUCCEEDED)
    assert late.status is Status.ESCALATED
    assert late.cause is Cause.EVIDENCE_CONFLICT
    assert Flag.EVIDENCE_CONFLICT in late.flags


def test_a_late_outcome_that_says_nothing_changes_nothing() -> None:
    hints = Hints()
    flagged = flag_missing_evidence(admit(InvocationState(), hints, "a1"), hints, "a1")
    late = report_outcome(flagged, hints, "a1", 1, OutcomeKind.DISPATCH_NOT_ESTABLISHED)
    assert late == flagged


IN_FLIGHT = InvocationState(status=Status.IN_FLIGHT, attempts=1, in_flight_attempt="a1")
LOST = OutcomeKind.POST_DISPATCH_EVIDENCE_FAILED
REPORTED_LOST = InvocationState(
    status=Status.RECONCILIATION_REQUIRED,
    failure_class=LOST,
    cause=Cause.EVIDENCE_REPORTED_LOST,
    attempts=1,
)
SUCCEEDED = InvocationState(status=Status.SUCCEEDED, attempts=1)


@pytest.mark.parametrize(
    ("before", "after", "explained"),
    [
        (InvocationState(), IN_FLIGHT, True),
        (IN_FLIGHT, REPORTED_LOST, True),
        (IN_FLIGHT, SUCCEEDED, True),
        (SUCCEEDED, replace(SUCCEEDED, flags=frozenset({Flag.REFERENCE_SHARED})), False),
        # Reported lost on a write: retry only after reconciliation says it is safe.
        (IN_FLIGHT, replace(REPORTED_LOST, status=Status.RETRY_ALLOWED, cause=None), False),
        (REPORTED_LOST, replace(REPORTED_LOST, status=Status.RETRY_ALLOWED), False),
        (REPORTED_LOST, replace(IN_FLIGHT, attempts=2, in_flight_attempt="a2"), False),
        (InvocationState(), SUCCEEDED, False),  # an effect with no attempt
        (InvocationState(), replace(IN_FLIGHT, attempts=2), False),
        (IN_FLIGHT, replace(IN_FLIGHT, in_flight_attempt="a2"), False),  # not admitted
        (SUCCEEDED, replace(SUCCEEDED, status=Status.RETRY_ALLOWED), False),
        (
            replace(SUCCEEDED, flags=frozenset({Flag.EVIDENCE_CONFLICT})),
            SUCCEEDED,  # a flag taken away
            False,
        ),
    ],
)
def test_a_recorded_step_is_explained_only_by_a_rule(
    before: InvocationState, after: InvocationState, explained: bool
) -> None:
    assert explains(before, after, Hints()) is explained


def test_a_flag_is_explained_only_by_an_event_that_sets_it() -> None:
    shared = replace(SUCCEEDED, flags=frozenset({Flag.REFERENCE_SHARED}))
    late_success = FLAGS_BESIDE_A_RULE["late_outcome_recorded"]
    assert explains(SUCCEEDED, shared, Hints(), late_success)
    assert not explains(SUCCEEDED, shared, Hints(), FLAGS_BESIDE_A_RULE["intent_recorded"])
    undeclared = replace(SUCCEEDED, flags=frozenset({Flag.UNDECLARED}))
    assert not explains(SUCCEEDED, undeclared, Hints(), late_success)
    # A flag already set stays explained by every later event.
    assert explains(shared, replace(shared, status=Status.SUCCEEDED), Hints())


def test_whether_a_step_is_explained_depends_on_the_capability() -> None:
    retry = replace(REPORTED_LOST, status=Status.RETRY_ALLOWED, cause=None)
    assert explains(IN_FLIGHT, retry, Hints(readonly=True))
    assert not explains(IN_FLIGHT, retry, Hints(readonly=False))
    exhausted = replace(retry, status=Status.FAILED, cause=Cause.ATTEMPTS_EXHAUSTED)
    assert explains(IN_FLIGHT, exhausted, Hints(readonly=True, max_attempts=1))
    assert not explains(IN_FLIGHT, exhausted, Hints(readonly=True, max_attempts=2))


class InvocationMachine(RuleBasedStateMachine):
    """Any sequence of admissions, outcomes (timely or late), sweeps and resolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.hints = Hints()
        self.state = InvocationState()
        self.attempts: list[str] = []
        self.previous = self.state

    @rule(
        readonly=st.booleans(),
        verified=st.booleans(),
        max_attempts=st.integers(min_value=1, max_value=4),
    )
    @precondition(lambda self: not self.attempts)
    def choose_capability(self, readonly: bool, verified: bool, max_attempts: int) -> None:
        self.hints = Hints(readonly, verified, max_attempts)

    def step(self, new: InvocationState) -> None:
        self.previous, self.state = self.state, new

    @rule()
    def admit(self) -> None:
        attempt_id = f"a{len(self.attempts) + 1}"
        try:
            new = admit(self.state, self.hints, attempt_id)
        except Refused:
            assert self.state.status not in (Status.RECORDED, Status.RETRY_ALLOWED) or (
                self.state.attempts >= self.hints.max_attempts
            )
            return
        # No attempt is admitted while reconciliation is required.
        assert not self.state.reconciliation_required
        self.attempts.append(attempt_id)
        self.step(new)

    @rule(
        pick=st.integers(min_value=0, max_value=10),
        kind=st.sampled_from(OutcomeKind),
        retryable=st.booleans(),
        names_another_effect=st.booleans(),
    )
    @precondition(lambda self: self.attempts)
    def report(
        self, pick: int, kind: OutcomeKind, retryable: bool, names_another_effect: bool
    ) -> None:
        number = pick % len(self.attempts) + 1
        attempt_id = self.attempts[number - 1]
        self.step(
            report_outcome(
                self.state,
                self.hints,
                attempt_id,
                number,
                kind,
                retryable,
                names_another_effect=names_another_effect,
            )
        )

    @rule()
    def sweep(self) -> None:
        if self.state.in_flight_attempt is None:
            with pytest.raises(Refused):
                flag_missing_evidence(self.state, self.hints, "a1")
            return
        self.step(flag_missing_evidence(self.state, self.hints, self.state.in_flight_attempt))

    @rule(effect=st.sampled_from(Effect))
    def resolve(self, effect: Effect) -> None:
        try:
            self.step(resolve(self.state, self.hints, effect))
        except Refused:
            assert not self.state.reconciliation_required

    @rule()
    def claim(self) -> None:
        try:
            self.step(claim(self.state))
        except Refused:
            assert self.state.status not in (Status.RECONCILIATION_REQUIRED, Status.ESCALATED)

    @rule()
    def release(self) -> None:
        try:
            self.step(release(self.state))
        except Refused:
            assert self.state.status is not Status.RECONCILING

    @rule()
    def escalate(self) -> None:
        try:
            self.step(escalate(self.state, Cause.PROBE_INCONCLUSIVE))
        except Refused:
            assert self.state.status not in (Status.RECONCILING, Status.RECONCILIATION_REQUIRED)

    @rule(approve=st.booleans())
    def propose_then_decide(self, approve: bool) -> None:
        try:
            self.step(propose(self.state))
        except Refused:
            return
        if not approve:
            self.step(reject_proposal(self.state))

    @invariant()
    def at_most_one_attempt_in_flight(self) -> None:
        in_flight = self.state.status is Status.IN_FLIGHT
        assert (self.state.in_flight_attempt is not None) is in_flight
        if in_flight:
            assert self.state.in_flight_attempt == self.attempts[-1]

    @invariant()
    def terminal_is_left_only_by_a_recorded_conflict(self) -> None:
        if self.previous.status in TERMINAL and self.state.status != self.previous.status:
            assert self.state.status is Status.ESCALATED
            assert self.state.cause is Cause.EVIDENCE_CONFLICT
            assert Flag.EVIDENCE_CONFLICT in self.state.flags

    @invariant()
    def every_step_is_one_verify_explains(self) -> None:
        # verify_ledger's replay must never call a history the services write broken.
        assert explains(self.previous, self.state, self.hints)

    @invariant()
    def attempts_never_exceed_the_maximum(self) -> None:
        assert self.state.attempts == len(self.attempts) <= self.hints.max_attempts

    @invariant()
    def typed_state_is_consistent(self) -> None:
        assert not (self.state.retryable and self.state.reconciliation_required)
        if self.state.status in TERMINAL:
            assert self.state.next_action is NextAction.NONE


InvocationMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30)
test_invocation_state_machine = InvocationMachine.TestCase
