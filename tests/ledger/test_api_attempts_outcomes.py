from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from ledger import chain
from ledger.models import Capability, Event, Invocation, Outcome
from tests.conftest import Api


@pytest.fixture
def in_flight(api: Api, refund: Capability) -> Api:
    assert api.intent(attempt_id="a1")[0] == 201
    return api


def test_a_success_is_terminal(in_flight: Api) -> None:
    status, body = in_flight.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-9")
    assert status == 201
    assert (body["status"], body["next_action"], body["retryable"]) == ("succeeded", "none", False)
    assert Outcome.objects.get().business_reference == "RF-9"


def test_lost_evidence_refuses_a_new_attempt_with_the_typed_state(in_flight: Api) -> None:
    status, body = in_flight.outcome("inv-1", "a1", kind="post_dispatch_evidence_failed")
    assert status == 201
    assert body["failure_class"] == "post_dispatch_evidence_failed"
    assert (body["retryable"], body["reconciliation_required"]) == (False, True)
    events_before = Event.objects.count()
    status, body = in_flight.attempt("inv-1", "a2")
    assert status == 409
    assert body["error"]["type"] == "attempt_refused"
    state = body["error"]["details"]["state"]
    assert (state["retryable"], state["reconciliation_required"]) == (False, True)
    assert state["next_action"] == "reconcile"
    assert Event.objects.count() == events_before


def test_one_invocation_reads_back_with_its_attempts_outcomes_and_chain(
    api: Api, lookup: Capability
) -> None:
    api.intent(capability="order.read", attempt_id="a1")
    unreachable = {"code": "E503", "message": "down"}
    api.outcome("inv-1", "a1", kind="dispatch_not_established", error=unreachable)
    api.attempt("inv-1", "a2")
    api.outcome("inv-1", "a2", kind="succeeded", result={"order": "SO-1"})
    status, body = api.get("/api/v1/invocations/inv-1")
    assert status == 200
    assert (body["status"], body["capability"], body["arguments"]) == (
        "succeeded", "order.read", {"order": "SO-1", "amount": "12.50"},
    )  # fmt: skip
    assert [(a["attempt_id"], a["number"], a["outcome"]["kind"]) for a in body["attempts"]] == [
        ("a1", 1, "dispatch_not_established"),
        ("a2", 2, "succeeded"),
    ]
    assert body["attempts"][0]["outcome"]["error_code"] == "E503"
    assert body["attempts"][1]["outcome"]["result"] == {"order": "SO-1"}
    stored = Event.objects.filter(invocation__invocation_id="inv-1").order_by("seq")
    assert [(e["seq"], e["kind"], e["hash"]) for e in body["events"]] == [
        (e.seq, e.kind, e.hash) for e in stored
    ]
    assert body["events"][0]["prev_hash"] == chain.GENESIS_HASH


def test_a_readonly_capability_may_retry_after_lost_evidence(api: Api, lookup: Capability) -> None:
    api.intent(capability="order.read", attempt_id="a1")
    status, body = api.outcome("inv-1", "a1", kind="post_dispatch_evidence_failed")
    assert (status, body["status"], body["retryable"]) == (201, "retry_allowed", True)
    assert api.attempt("inv-1", "a2")[0] == 201


def test_a_second_attempt_while_one_is_in_flight_is_refused(in_flight: Api) -> None:
    status, body = in_flight.attempt("inv-1", "a2")
    assert (status, body["error"]["type"]) == (409, "attempt_in_flight")


def test_a_retryable_business_failure_admits_a_new_attempt_under_the_same_key(
    in_flight: Api,
) -> None:
    _, body = in_flight.outcome("inv-1", "a1", kind="business_failed", retryable=True)
    assert body["status"] == "retry_allowed"
    status, body = in_flight.attempt("inv-1", "a2")
    assert (status, body["status"]) == (201, "in_flight")
    assert Invocation.objects.get().attempt_count == 2


def test_a_replayed_attempt_and_outcome_change_nothing(in_flight: Api) -> None:
    assert in_flight.attempt("inv-1", "a1")[0] == 200
    first = in_flight.outcome("inv-1", "a1", kind="succeeded", result={"refund": "RF-1"})
    events = Event.objects.count()
    replay = in_flight.outcome("inv-1", "a1", kind="succeeded", result={"refund": "RF-1"})
    assert replay == (200, first[1])
    assert Event.objects.count() == events
    assert Outcome.objects.count() == 1


def test_a_different_outcome_for_the_same_attempt_is_kept_as_a_flagged_claim(
    in_flight: Api,
) -> None:
    in_flight.outcome("inv-1", "a1", kind="succeeded")
    status, body = in_flight.outcome(
        "inv-1", "a1", kind="business_failed", business_reference="RF-2"
    )
    assert (status, body["error"]["type"]) == (409, "outcome_conflict")
    assert body["error"]["details"]["fields"] == ["business_reference", "kind"]
    invocation = Invocation.objects.get()
    assert invocation.flags == ["evidence_conflict"]
    assert Outcome.objects.get().kind == "succeeded"
    claim = invocation.events.get(kind="outcome_conflict")
    assert claim.data["claimed"]["kind"] == "business_failed"
    assert claim.data["business_reference"] == "RF-2"  # found by it, like an outcome's


def test_the_same_conflicting_claim_again_is_answered_alike_and_kept_once(
    in_flight: Api,
) -> None:
    in_flight.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    first = in_flight.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-2")
    again = in_flight.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-2")
    other = in_flight.outcome("inv-1", "a1", kind="business_failed")

    assert first == again and first[0] == 409
    assert other[1]["error"]["details"]["fields"] == ["business_reference", "kind"]
    claims = Event.objects.filter(kind="outcome_conflict").order_by("seq")
    assert [c.data["claimed"]["kind"] for c in claims] == ["succeeded", "business_failed"]


def test_one_batch_sending_a_conflicting_claim_twice_keeps_it_once(in_flight: Api) -> None:
    claim = {"type": "outcome", "invocation_id": "inv-1", "attempt_id": "a1", "kind": "succeeded"}
    status, body = in_flight.post(
        "/api/v1/evidence",
        [claim, {**claim, "kind": "business_failed"}, {**claim, "kind": "business_failed"}],
    )

    assert status == 207
    assert [r["status"] for r in body["results"]] == [201, 409, 409]
    assert Event.objects.filter(kind="outcome_conflict").count() == 1


def test_a_success_naming_another_invocations_reference_is_flagged(
    api: Api, refund: Capability, api_b: Api
) -> None:
    """Two intents, one refund: the second to name it is flagged for compliance, and
    its event names the first by id when the same runtime recorded both. Nothing is
    refused."""
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    api.intent(invocation_id="inv-2", idempotency_key="k-2", attempt_id="a1")

    status, body = api.outcome("inv-2", "a1", kind="succeeded", business_reference="RF-1")
    replayed = api.outcome("inv-2", "a1", kind="succeeded", business_reference="RF-1")

    assert (status, body["status"], body["flags"]) == (201, "succeeded", ["reference_shared"])
    assert replayed == (200, body)
    second = Event.objects.get(invocation__invocation_id="inv-2", kind="outcome_recorded")
    assert second.data["also_named_by"] == ["inv-1"]
    assert "also_named_elsewhere" not in second.data
    assert Invocation.objects.get(invocation_id="inv-1").flags == []


def test_a_reference_another_runtime_named_is_flagged_without_naming_its_invocation(
    api: Api, refund: Capability, api_b: Api
) -> None:
    """Runtime B is told that its refund's reference is named elsewhere, but never
    which invocation of runtime A's names it: A's invocations are 404 to B."""
    api.intent(invocation_id="a-refund-for-order-17", idempotency_key="k-1", attempt_id="a1")
    api.outcome("a-refund-for-order-17", "a1", kind="succeeded", business_reference="RF-1")
    api_b.intent(invocation_id="inv-2", idempotency_key="k-2", attempt_id="a1")

    status, body = api_b.outcome("inv-2", "a1", kind="succeeded", business_reference="RF-1")

    assert (status, body["flags"]) == (201, ["reference_shared"])
    status, detail = api_b.get("/api/v1/invocations/inv-2")
    assert status == 200
    (recorded,) = [e for e in detail["events"] if e["kind"] == "outcome_recorded"]
    assert recorded["data"]["also_named_elsewhere"] == 1
    assert "also_named_by" not in recorded["data"]
    assert "order-17" not in json.dumps(detail)


def test_a_reference_named_twice_in_one_batch_flags_the_second(
    api: Api, refund: Capability
) -> None:
    items: list[dict[str, Any]] = [
        {"type": "intent", "invocation_id": name, "task_id": "t", "capability": "refund.create",
         "arguments": {}, "idempotency_key": name, "attempt_id": "a1"}
        for name in ("inv-a", "inv-b", "inv-c")
    ] + [
        {"type": "outcome", "invocation_id": name, "attempt_id": "a1", "kind": kind,
         "business_reference": reference}
        for name, kind, reference in (
            ("inv-a", "succeeded", "RF-9"),
            ("inv-b", "succeeded", "RF-9"),
            ("inv-c", "business_failed", "RF-9"),  # a rejection's id names no effect
        )
    ]  # fmt: skip

    status, body = api.post("/api/v1/evidence", items)

    assert status == 207
    flags = [result["body"]["flags"] for result in body["results"][3:]]
    assert flags == [[], ["reference_shared"], []]


def test_a_result_is_digested_and_masked(in_flight: Api) -> None:
    result = {"refund_id": "RF-1", "token": "tok_live"}
    in_flight.outcome("inv-1", "a1", kind="succeeded", result=result)
    outcome = Outcome.objects.get()
    assert outcome.result == {"refund_id": "RF-1", "token": "[redacted]"}
    assert outcome.result_digest == chain.digest(result)


def test_a_result_holding_nul_is_refused_and_changes_nothing(in_flight: Api) -> None:
    status, body = in_flight.outcome("inv-1", "a1", kind="succeeded", result={"id": "RF\x00"})
    assert (status, body["error"]["type"]) == (400, "validation_failed")
    assert "result" in body["error"]["details"]
    assert not Outcome.objects.exists()


def test_an_outcome_for_an_unknown_attempt_is_not_found(in_flight: Api) -> None:
    status, body = in_flight.outcome("inv-1", "a9", kind="succeeded")
    assert (status, body["error"]["type"]) == (404, "not_found")


@pytest.mark.parametrize(
    ("body", "details"),
    [
        ({"kind": "exploded"}, {"kind": ["Invalid enum value 'exploded' - at `$.kind`"]}),
        (
            {"kind": "succeeded", "retryable": True},
            {"retryable": ["Only a business_failed outcome carries retryable."]},
        ),
        (
            {"kind": "succeeded", "retryable": "yes"},
            {"retryable": ["Expected `bool`, got `str` - at `$.retryable`"]},
        ),
        (
            {"kind": "succeeded", "error": {"code": 5}},
            {"error": ["Expected `str`, got `int` - at `$.error.code`"]},
        ),
        (
            {"kind": "succeeded", "error": {"code": "E1\n"}},
            {"error": ["Control characters are not allowed. (at `$.error.code`)"]},
        ),
        (
            {"kind": "succeeded", "error": {"code": "E1", "stack": "..."}},
            {"error": ["Object contains unknown field `stack` - at `$.error`"]},
        ),
        ({}, {"kind": ["This field is required."]}),
        (
            {"kind": "pre_dispatch_rejected", "business_reference": "RF-1"},
            {
                "business_reference": [
                    "A pre_dispatch_rejected outcome names no business reference."
                ]
            },
        ),
        (
            {"kind": "dispatch_not_established", "business_reference": "RF-1"},
            {
                "business_reference": [
                    "A dispatch_not_established outcome names no business reference."
                ]
            },
        ),
    ],
)
def test_a_bad_outcome_is_refused_by_field_and_changes_nothing(
    in_flight: Api, body: dict, details: dict
) -> None:
    events = Event.objects.count()
    status, answer = in_flight.outcome("inv-1", "a1", **body)
    assert (status, answer["error"]["type"]) == (400, "validation_failed")
    assert answer["error"]["details"] == details
    assert Event.objects.count() == events
    assert Invocation.objects.get().status == "in_flight"


def test_a_late_outcome_after_a_flag_completes_the_evidence(in_flight: Api) -> None:
    from ledger.services import flag_missing_evidence

    invocation = Invocation.objects.get()
    assert flag_missing_evidence(invocation_id="inv-1", now=invocation.deadline_at)
    _, body = in_flight.get("/api/v1/invocations/inv-1")
    assert (body["status"], body["cause"]) == ("reconciliation_required", "evidence_missing")
    status, body = in_flight.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    assert (status, body["status"]) == (201, "succeeded")
    kinds = list(Invocation.objects.get().events.order_by("seq").values_list("kind", flat=True))
    assert kinds[-2:] == ["evidence_missing", "late_outcome_recorded"]


def test_the_sweeper_flags_only_overdue_attempts(in_flight: Api) -> None:
    from ledger.services import flag_missing_evidence

    deadline = Invocation.objects.get().deadline_at
    assert deadline is not None
    early = deadline - dt.timedelta(seconds=1)
    assert not flag_missing_evidence(invocation_id="inv-1", now=early)
    assert Invocation.objects.get().status == "in_flight"


def test_the_detail_shows_attempts_outcomes_and_a_verifiable_chain(in_flight: Api) -> None:
    in_flight.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    status, body = in_flight.get("/api/v1/invocations/inv-1")
    assert status == 200
    assert body["attempts"][0]["outcome"]["business_reference"] == "RF-1"
    prev = chain.GENESIS_HASH
    for event in body["events"]:
        assert event["prev_hash"] == prev
        prev = event["hash"]
    invocation = Invocation.objects.get()
    assert invocation.head_hash == prev
    from ledger.services import event_body

    for event in invocation.events.order_by("seq"):
        assert chain.event_hash(event.prev_hash, event_body(event, "inv-1")) == event.hash


def test_the_listing_is_keyset_paginated_and_filtered(api: Api, refund: Capability) -> None:
    for n in range(5):
        api.intent(
            invocation_id=f"inv-{n}",
            idempotency_key=f"k{n}",
            task_id="t-even" if n % 2 == 0 else "t-odd",
        )
    status, page = api.get("/api/v1/invocations", limit=2)
    assert [row["invocation_id"] for row in page["results"]] == ["inv-0", "inv-1"]
    response = api.client.get(page["next"], headers=api.headers())
    assert [r["invocation_id"] for r in response.json()["results"]] == ["inv-2", "inv-3"]
    _, filtered = api.get("/api/v1/invocations", task_id="t-even")
    assert [r["invocation_id"] for r in filtered["results"]] == ["inv-0", "inv-2", "inv-4"]
    _, none = api.get("/api/v1/invocations", status="succeeded")
    assert none == {"results": [], "next": None}
    status, bad = api.get("/api/v1/invocations", status="bogus")
    assert (status, bad["error"]["type"]) == (400, "validation_failed")
