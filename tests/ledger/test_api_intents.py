from __future__ import annotations

import datetime as dt
import gzip
import json

import pytest

from ledger import chain
from ledger.models import Attempt, Capability, Event, Invocation
from tests.conftest import Api, intent_body


def counts() -> tuple[int, int, int]:
    return Invocation.objects.count(), Attempt.objects.count(), Event.objects.count()


def test_it_records_an_intent_and_admits_the_first_attempt(api: Api, refund: Capability) -> None:
    status, body = api.intent(attempt_id="a1")
    assert status == 201
    assert body == {
        "invocation_id": "inv-1",
        "status": "in_flight",
        "failure_class": None,
        "cause": None,
        "retryable": False,
        "reconciliation_required": False,
        "next_action": "await_outcome",
        "flags": [],
    }
    invocation = Invocation.objects.get()
    assert invocation.arguments_digest == chain.digest({"order": "SO-1", "amount": "12.50"})
    assert [e.kind for e in invocation.events.order_by("seq")] == [
        "intent_recorded",
        "attempt_admitted",
    ]


def test_it_records_an_intent_without_attempt_as_recorded(api: Api, refund: Capability) -> None:
    status, body = api.intent()
    assert (status, body["status"], body["next_action"]) == (201, "recorded", "dispatch")


def test_a_w3c_traceparent_is_kept(api: Api, refund: Capability) -> None:
    sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"  # the spec's example
    status, _ = api.post("/api/v1/intents", intent_body(traceparent=sent))
    assert status == 201
    assert Invocation.objects.get().traceparent == sent


def test_the_request_time_is_kept_as_its_instant_in_utc(api: Api, refund: Capability) -> None:
    status, _ = api.intent(requested_at="2026-12-02T10:00:00.250+01:00")
    assert status == 201
    invocation = Invocation.objects.get()
    assert invocation.requested_at == dt.datetime(2026, 12, 2, 9, 0, 0, 250000, tzinfo=dt.UTC)
    recorded = invocation.events.get(kind="intent_recorded")
    assert recorded.data["requested_at"] == "2026-12-02T09:00:00.250000+00:00"


def test_an_offset_postgresql_cannot_hold_is_moved_to_utc(api: Api, refund: Capability) -> None:
    # RFC 3339 allows -22:48; PostgreSQL refuses offsets past ±15:59 (found by schemathesis).
    status, _ = api.intent(requested_at="0211-04-15T22:40:22.221568-22:48")
    assert status == 201
    stored = Invocation.objects.get().requested_at
    assert stored == dt.datetime(211, 4, 16, 21, 28, 22, 221568, tzinfo=dt.UTC)


def test_a_time_that_leaves_the_calendar_in_utc_is_refused(api: Api, refund: Capability) -> None:
    status, answer = api.intent(requested_at="0001-01-01T00:00:00+05:00")
    assert (status, answer["error"]["type"]) == (400, "validation_failed")
    assert answer["error"]["details"] == {"requested_at": ["Out of range once moved to UTC."]}
    assert counts() == (0, 0, 0)


def test_a_replayed_intent_returns_the_same_body_and_writes_nothing(
    api: Api, refund: Capability
) -> None:
    first = api.intent(attempt_id="a1")
    before = counts()
    replay = api.intent(attempt_id="a1")
    assert replay == (200, first[1])
    assert counts() == before


def test_a_different_intent_under_the_same_id_is_a_conflict_listing_fields(
    api: Api, refund: Capability
) -> None:
    api.intent()
    before = counts()
    status, body = api.intent(task_id="task-2", arguments={"order": "SO-2"})
    assert status == 409
    assert body["error"]["type"] == "intent_conflict"
    assert body["error"]["details"]["fields"] == ["arguments", "task_id"]
    assert counts() == before


def test_the_same_key_on_another_invocation_is_refused(api: Api, refund: Capability) -> None:
    api.intent()
    status, body = api.intent(invocation_id="inv-2")
    assert status == 409
    assert body["error"]["type"] == "idempotency_key_in_use"
    assert body["error"]["details"]["invocation_id"] == "inv-1"
    assert Invocation.objects.count() == 1


def test_another_runtime_does_not_learn_which_invocation_holds_a_key(
    api: Api, api_b: Api, refund: Capability
) -> None:
    api.intent()
    status, body = api_b.intent(invocation_id="inv-b")
    assert (status, body["error"]["type"]) == (409, "idempotency_key_in_use")
    assert "invocation_id" not in body["error"]["details"]


def test_the_same_key_under_another_capability_is_another_intent(
    api: Api, refund: Capability
) -> None:
    api.intent()
    status, _ = api.intent(invocation_id="inv-2", capability="refund.cancel")
    assert status == 201


def test_an_undeclared_capability_is_accepted_with_conservative_hints(api: Api) -> None:
    status, body = api.intent(capability="payroll.change")
    assert status == 201
    assert body["flags"] == ["undeclared"]
    invocation = Invocation.objects.get()
    assert (invocation.hint_readonly, invocation.hint_idempotency_verified) == (False, False)
    assert invocation.risk_level == "high"


def test_a_disabled_capability_refuses_the_intent(api: Api) -> None:
    Capability.objects.create(scope="refund.create", enabled=False)
    status, body = api.intent()
    assert (status, body["error"]["type"]) == (422, "capability_disabled")
    assert Invocation.objects.count() == 0


def test_a_subject_required_capability_refuses_an_intent_without_subject(api: Api) -> None:
    Capability.objects.create(scope="refund.create", subject_required=True)
    status, body = api.intent()
    assert (status, body["error"]["type"]) == (422, "subject_required")
    assert api.intent(subject="customer:42")[0] == 201


def test_a_required_approval_that_is_missing_is_flagged(api: Api) -> None:
    Capability.objects.create(
        scope="refund.create",
        declaration={
            "version": 1,
            "enabled": True,
            "scope": "refund.create",
            "approval": {"required": True},
        },
    )
    assert api.intent()[1]["flags"] == ["approval_missing"]
    approved = api.intent(
        invocation_id="inv-2", idempotency_key="k2", approval={"approved_by": "alice"}
    )
    assert approved[1]["flags"] == []


def test_secret_looking_arguments_never_reach_the_database(api: Api, refund: Capability) -> None:
    api.intent(
        arguments={"card_number": "4111111111111111", "nested": {"api_key": "s3cr3t"}, "amount": 5}
    )
    stored = Invocation.objects.get().arguments
    assert stored == {"card_number": "[redacted]", "nested": {"api_key": "[redacted]"}, "amount": 5}


def test_sensitive_capabilities_keep_only_the_digest_and_a_masked_copy(api: Api) -> None:
    Capability.objects.create(scope="refund.create", audit_sensitive=True)
    arguments = {"employee": "E-7", "salary": 91000}
    api.intent(arguments=arguments, attempt_id="a1")
    invocation = Invocation.objects.get()
    assert invocation.arguments == {"employee": "[redacted]", "salary": "[redacted]"}
    assert invocation.arguments_digest == chain.digest(arguments)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT row_to_json(i)::text FROM ledger_invocation i")
        row = cursor.fetchone()[0]
        cursor.execute("SELECT string_agg(data::text, ' ') FROM ledger_event")
        events = cursor.fetchone()[0]
    assert "E-7" not in row and "91000" not in row
    assert "E-7" not in events and "91000" not in events


def test_listed_paths_are_masked(api: Api) -> None:
    Capability.objects.create(scope="refund.create", redact_paths=["customer.iban_last4"])
    api.intent(arguments={"customer": {"iban_last4": "1234", "name": "Ada"}})
    assert Invocation.objects.get().arguments == {
        "customer": {"iban_last4": "[redacted]", "name": "Ada"}
    }


def test_a_digest_alone_is_accepted(api: Api, refund: Capability) -> None:
    digest = chain.digest({"a": 1})
    status, _ = api.intent(arguments=None, arguments_digest=digest)
    assert status == 201
    assert Invocation.objects.get().arguments is None


def test_a_digest_that_does_not_match_the_arguments_is_refused(api: Api) -> None:
    status, body = api.intent(arguments_digest=chain.digest({"other": True}))
    assert (status, body["error"]["type"]) == (400, "validation_failed")
    assert "arguments_digest" in body["error"]["details"]


def nest(depth: int) -> object:
    return {"a": nest(depth - 1)} if depth else 1


BAD_BODIES = [
    ("not json", "{", "malformed_request", None),
    ("nan", '{"invocation_id": "x", "arguments": NaN}', "malformed_request", None),
    (
        "number past a double",
        '{"invocation_id": "x", "arguments": 1e400}',
        "malformed_request",
        None,
    ),
    # JSON's grammar allows a lone surrogate; Unicode and PostgreSQL do not (it was a 500).
    ("lone surrogate", '{"invocation_id": "x", "subject": "\\ud800"}', "malformed_request", None),
    (
        "lone low surrogate",
        '{"invocation_id": "x", "subject": "\\udfff"}',
        "malformed_request",
        None,
    ),
    # RFC 8785 forbids them; the runtime's parser may have kept the first value.
    (
        "duplicate key",
        '{"invocation_id": "inv-1", "invocation_id": "inv-2", "task_id": "t"}',
        "malformed_request",
        None,
    ),
    (
        "duplicate key in arguments",
        '{"invocation_id": "inv-1", "arguments": {"amount": "1", "amount": "9"}}',
        "malformed_request",
        None,
    ),
    ("array", "[]", "validation_failed", "non_field_errors"),
    ("unknown field", {**intent_body(), "colour": "red"}, "validation_failed", "colour"),
    (
        "missing field",
        {k: v for k, v in intent_body().items() if k != "task_id"},
        "validation_failed",
        "task_id",
    ),
    ("wrong type", intent_body(task_id=7), "validation_failed", "task_id"),
    (
        "control character",
        intent_body(invocation_id="inv\x00-1"),
        "validation_failed",
        "invocation_id",
    ),
    (
        "newline in key",
        intent_body(idempotency_key="k\n1"),
        "validation_failed",
        "idempotency_key",
    ),
    ("too long id", intent_body(invocation_id="i" * 129), "validation_failed", "invocation_id"),
    # Ids travel in URL paths: one holding "/" could never be sent its outcome.
    ("slash in id", intent_body(invocation_id="tenant/42"), "validation_failed", "invocation_id"),
    # Python's `$` alone would let a final newline through.
    ("final newline", intent_body(invocation_id="inv-1\n"), "validation_failed", "invocation_id"),
    (
        "time without offset",
        intent_body(requested_at="2026-12-02T10:00:00"),
        "validation_failed",
        "requested_at",
    ),
    ("approval not an object", intent_body(approval=[1]), "validation_failed", "approval"),
    (
        "huge integer",
        intent_body(arguments={"amount": 2**64}),
        "validation_failed",
        "arguments",
    ),
    ("too deep", intent_body(arguments=nest(40)), "validation_failed", "arguments"),
    # PostgreSQL's jsonb cannot hold U+0000: refused up front, never a 500.
    ("NUL in a value", intent_body(arguments={"note": "a\x00b"}), "validation_failed", "arguments"),
    ("NUL in a key", intent_body(arguments={"a\x00": 1}), "validation_failed", "arguments"),
    ("bad traceparent", intent_body(traceparent="00-zz"), "validation_failed", "traceparent"),
    *[
        (f"traceparent {name}", intent_body(traceparent=value), "validation_failed", "traceparent")
        for name, value in (
            ("version ff", f"ff-{'1' * 32}-{'1' * 16}-01"),
            ("zero trace id", f"00-{'0' * 32}-{'1' * 16}-01"),
            ("zero parent id", f"00-{'1' * 32}-{'0' * 16}-01"),
        )
    ],
    ("no arguments", intent_body(arguments=None), "validation_failed", "arguments"),
    ("empty key", intent_body(idempotency_key=""), "validation_failed", "idempotency_key"),
    ("bad scope", intent_body(capability="refund create"), "validation_failed", "capability"),
]


@pytest.mark.parametrize(
    ("case", "body", "error", "field"), BAD_BODIES, ids=[case[0] for case in BAD_BODIES]
)
def test_bad_input_gets_a_typed_error_and_writes_nothing(
    api: Api, refund: Capability, case: str, body: object, error: str, field: str | None
) -> None:
    status, answer = api.post("/api/v1/intents", body)
    assert status == 400
    assert answer["error"]["type"] == error
    assert answer["error"]["message"]
    if field:
        assert field in answer["error"]["details"]
    assert counts() == (0, 0, 0)


def test_a_refused_identifier_is_told_what_to_send(api: Api, refund: Capability) -> None:
    status, answer = api.post("/api/v1/intents", intent_body(invocation_id="inv 1"))
    assert status == 400
    assert answer["error"]["details"] == {
        "invocation_id": [
            "Use letters, digits and . _ : @ + = - only, starting with a letter or digit."
        ]
    }


def test_one_refusal_names_every_field_at_fault(api: Api, refund: Capability) -> None:
    body = {**intent_body(invocation_id="inv 1", subject=7), "colour": "red", "size": 1}
    del body["task_id"]
    status, answer = api.post("/api/v1/intents", body)
    assert status == 400
    assert answer["error"]["details"] == {
        "colour": ["Unknown field."],
        "size": ["Unknown field."],
        "invocation_id": [
            "Use letters, digits and . _ : @ + = - only, starting with a letter or digit."
        ],
        "task_id": ["This field is required."],
        "subject": ["Expected `str`, got `int` - at `$.subject`"],
    }
    assert counts() == (0, 0, 0)


def test_a_lone_surrogate_is_named_as_such(api: Api, refund: Capability) -> None:
    raw = '{"invocation_id": "inv-1", "subject": "\\ud800"}'
    assert "\\ud800" in raw  # the six characters of the escape, not a code point
    status, answer = api.post("/api/v1/intents", raw)
    assert (status, answer["error"]["type"]) == (400, "malformed_request")
    assert "lone UTF-16 surrogate" in answer["error"]["message"]


def test_a_duplicate_key_is_named(api: Api, refund: Capability) -> None:
    raw = '{"invocation_id": "inv-1", "arguments": {"a": [{"b": 1, "\\u0062": 2}]}}'
    status, answer = api.post("/api/v1/intents", raw)
    assert (status, answer["error"]["type"]) == (400, "malformed_request")
    assert "the key 'b' appears twice in one object" in answer["error"]["message"]
    assert counts() == (0, 0, 0)


def test_keys_repeated_in_different_objects_and_colons_in_strings_are_fine(
    api: Api, refund: Capability
) -> None:
    arguments = {"order": {"order": "SO:1"}, 'say "a:b"': "c:\\", "lines": [{"n": 1}, {"n": 2}]}
    status, body = api.intent(arguments=arguments)
    assert (status, body["status"]) == (201, "recorded")
    assert Invocation.objects.get().arguments == arguments


def test_an_oversized_body_is_refused_with_413(api: Api, settings: object) -> None:
    body = intent_body(arguments={"blob": "x" * (256 * 1024)})
    status, answer = api.post("/api/v1/intents", body)
    assert (status, answer["error"]["type"]) == (413, "payload_too_large")
    assert counts() == (0, 0, 0)


def test_a_body_that_is_not_json_media_type_is_refused(api: Api) -> None:
    response = api.client.post(
        "/api/v1/intents",
        "a=b",
        content_type="application/x-www-form-urlencoded",
        headers=api.headers(),
    )
    assert response.status_code == 415
    assert response.json()["error"]["type"] == "unsupported_media_type"


def test_a_compressed_body_is_refused_by_its_encoding_not_as_bad_json(api: Api) -> None:
    response = api.client.post(
        "/api/v1/intents",
        gzip.compress(json.dumps(intent_body()).encode()),
        content_type="application/json",
        headers={**api.headers(), "Content-Encoding": "gzip"},
    )
    assert response.status_code == 415
    assert response.json()["error"] == {
        "type": "unsupported_media_type",
        "message": "Content-Encoding 'gzip' is not accepted: send the JSON uncompressed.",
        "details": {},
    }
    assert counts() == (0, 0, 0)


def test_the_api_answers_json_whatever_accept_asks_for(api: Api, refund: Capability) -> None:
    # Before the runtime API ignored Accept, this was a 406 with nothing recorded.
    response = api.client.post(
        "/api/v1/intents",
        intent_body(),
        content_type="application/json",
        headers={**api.headers(), "Accept": "text/html"},
    )
    assert response.status_code == 201
    assert response["Content-Type"] == "application/json"
    assert response.json()["status"] == "recorded"
    assert counts() == (1, 0, 1)
