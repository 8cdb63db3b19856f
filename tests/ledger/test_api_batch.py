from __future__ import annotations

import json
import uuid
from typing import Any

from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import policy
from ledger.integrity import verify
from ledger.models import Capability, Event, Invocation
from tests.conftest import Api, intent_body


def intent_item(**fields: Any) -> dict[str, Any]:
    return {"type": "intent", **intent_body(**fields)}


def outcome_item(invocation_id: str, attempt_id: str, **body: Any) -> dict[str, Any]:
    return {"type": "outcome", "invocation_id": invocation_id, "attempt_id": attempt_id, **body}


def test_it_applies_items_in_order_with_one_result_each(api: Api, refund: Capability) -> None:
    status, body = api.post(
        "/api/v1/evidence",
        [
            intent_item(attempt_id="a1"),
            outcome_item("inv-1", "a1", kind="business_failed", retryable=True),
            {"type": "attempt", "invocation_id": "inv-1", "attempt_id": "a2"},
            outcome_item("inv-1", "a2", kind="succeeded"),
        ],
    )
    assert status == 207
    assert [(r["status"], r["body"]["status"]) for r in body["results"]] == [
        (201, "in_flight"),
        (201, "retry_allowed"),
        (201, "in_flight"),
        (201, "succeeded"),
    ]
    seqs = list(Invocation.objects.get().events.order_by("seq").values_list("seq", flat=True))
    assert seqs == [1, 2, 3, 4, 5]


def test_each_result_is_what_the_single_call_would_answer(
    api: Api, api_b: Api, refund: Capability
) -> None:
    """Runtime A uses single calls, runtime B the batch; the answers match."""
    script = [
        intent_item(attempt_id="a1"),
        intent_item(attempt_id="a1"),  # replay
        intent_item(task_id="other"),  # conflict
        intent_item(invocation_id="inv-2"),  # key in use
        {"type": "attempt", "invocation_id": "inv-1", "attempt_id": "a2"},  # in flight
        outcome_item("inv-1", "a1", kind="post_dispatch_evidence_failed"),
        {"type": "attempt", "invocation_id": "inv-1", "attempt_id": "a2"},  # refused
        outcome_item("inv-1", "a1", kind="succeeded"),  # outcome conflict
        outcome_item("nope", "a1", kind="succeeded"),  # not found
        intent_item(invocation_id="inv-3", idempotency_key="k3", subject=7),  # invalid
    ]
    single = []
    for item in script:
        body = {k: v for k, v in item.items() if k not in ("type",)}
        if item["type"] == "intent":
            single.append(api.post("/api/v1/intents", body))
        elif item["type"] == "attempt":
            single.append(api.attempt(item["invocation_id"], item["attempt_id"]))
        else:
            rest = {k: v for k, v in body.items() if k not in ("invocation_id", "attempt_id")}
            single.append(api.outcome(item["invocation_id"], item["attempt_id"], **rest))
    # Runtime B writes the same script under its own ids and keys.
    rename = {"inv-1": "b-1", "inv-2": "b-2", "inv-3": "b-3"}
    batch_items = []
    for item in script:
        copy = dict(item)
        copy["invocation_id"] = rename.get(copy["invocation_id"], copy["invocation_id"])
        if "idempotency_key" in copy:
            copy["idempotency_key"] = "b-" + copy["idempotency_key"]
        batch_items.append(copy)
    status, body = api_b.post("/api/v1/evidence", batch_items)
    assert status == 207

    def normalize(result: Any) -> Any:
        text = str(result)
        for a, b in rename.items():
            text = text.replace(b, a)
        return text.replace("b-refund", "refund")

    assert [r["status"] for r in body["results"]] == [s for s, _ in single]
    assert [normalize(r["body"]) for r in body["results"]] == [str(b) for _, b in single]


def test_a_batch_over_1000_items_is_refused_whole(api: Api, refund: Capability) -> None:
    items = [intent_item(invocation_id=f"i{n}", idempotency_key=f"k{n}") for n in range(1001)]
    status, body = api.post("/api/v1/evidence", items)
    assert (status, body["error"]["type"]) == (400, "validation_failed")
    assert "items" in body["error"]["details"]
    assert Invocation.objects.count() == 0


def test_a_batch_of_1000_items_is_applied(api: Api, refund: Capability) -> None:
    items = [
        intent_item(invocation_id=f"i{n}", idempotency_key=f"k{n}", attempt_id="a1")
        for n in range(1000)
    ]
    status, body = api.post("/api/v1/evidence", items)
    assert status == 207
    assert {r["status"] for r in body["results"]} == {201}
    assert Invocation.objects.count() == 1000
    assert Event.objects.count() == 2000


def test_a_batch_must_be_an_array(api: Api) -> None:
    status, body = api.post("/api/v1/evidence", {"type": "intent"})
    assert (status, body["error"]["type"]) == (400, "validation_failed")


def test_items_of_unknown_type_are_refused_in_place(api: Api, refund: Capability) -> None:
    status, body = api.post("/api/v1/evidence", [{"type": "delete"}, "x", intent_item()])
    assert status == 207
    assert [r["status"] for r in body["results"]] == [400, 400, 201]
    assert body["results"][0]["body"]["error"]["details"] == {
        "type": ["Must be one of: intent, attempt, outcome."]
    }


INVOCATIONS = ["inv-1", "inv-2"]
ATTEMPTS = ["a1", "a2", "a3"]
ITEMS = st.one_of(
    st.builds(
        lambda inv, key, task, capability, attempt: intent_item(
            invocation_id=inv, idempotency_key=key, task_id=task, capability=capability,
            attempt_id=attempt,
        ),
        st.sampled_from(INVOCATIONS), st.sampled_from(["k1", "k2"]), st.sampled_from(["t1", "t2"]),
        st.sampled_from(["refund.create", "order.read", "not.declared"]),
        st.none() | st.sampled_from(ATTEMPTS),
    ),
    st.builds(
        lambda inv, attempt: {"type": "attempt", "invocation_id": inv, "attempt_id": attempt},
        st.sampled_from(INVOCATIONS), st.sampled_from(ATTEMPTS),
    ),
    st.builds(
        lambda inv, attempt, kind, retryable: outcome_item(
            inv, attempt, kind=kind, **({"retryable": retryable} if retryable is not None else {})
        ),
        st.sampled_from(INVOCATIONS), st.sampled_from(ATTEMPTS),
        st.sampled_from([k.value for k in policy.OutcomeKind]), st.none() | st.booleans(),
    ),
)  # fmt: skip


def single_call(api: Api, item: dict[str, Any]) -> tuple[int, Any]:
    body = {k: v for k, v in item.items() if k != "type"}
    if item["type"] == "intent":
        return api.post("/api/v1/intents", body)
    invocation_id, attempt_id = body.pop("invocation_id"), body.pop("attempt_id")
    if item["type"] == "attempt":
        return api.attempt(invocation_id, attempt_id)
    return api.outcome(invocation_id, attempt_id, **body)


def under(prefix: str, item: dict[str, Any]) -> dict[str, Any]:
    """The item with its invocation ids and keys in a namespace of their own."""
    renamed = dict(item)
    renamed["invocation_id"] = f"{prefix}{item['invocation_id']}"
    if "idempotency_key" in item:
        renamed["idempotency_key"] = f"{prefix}{item['idempotency_key']}"
    return renamed


@settings(
    max_examples=60,
    deadline=None,
    # The fixtures are shared on purpose: each example writes under ids of its own.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(script=st.lists(ITEMS, min_size=1, max_size=12))
def test_any_script_answers_the_same_in_a_batch_as_in_single_calls(
    api: Api, refund: Capability, lookup: Capability, script: list[dict[str, Any]]
) -> None:
    """Generated scripts of intents, attempts and outcomes over two invocations: each
    batch result is the status and body of the single call, and both ledgers verify."""
    run, started = uuid.uuid4().hex[:8], timezone.now()
    single_prefix, batch_prefix = f"s{run}-", f"b{run}-"
    single = [single_call(api, under(single_prefix, item)) for item in script]
    status, body = api.post("/api/v1/evidence", [under(batch_prefix, i) for i in script])
    assert status == 207
    assert all(s < 500 for s, _ in single)
    batched = [(r["status"], r["body"]) for r in body["results"]]
    as_single = json.loads(json.dumps(batched).replace(batch_prefix, single_prefix))
    assert as_single == [list(result) for result in single]
    assert verify(since=started, projections=True).breaks == []
