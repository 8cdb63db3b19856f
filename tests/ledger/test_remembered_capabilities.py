"""New intents under a capability the process has read before skip the read.

The write then checks that every invocation is new and every capability still reads
as remembered; these tests change the capability behind the memory's back (as an
admin, a migration or another process would) and show the answer follows the row.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest

from ledger import store
from ledger.models import Capability, Event, Invocation
from tests.conftest import Api, registered


def test_a_new_intent_under_a_remembered_capability_is_one_write(
    api: Api, refund: Capability, statements: list[str]
) -> None:
    assert api.intent(invocation_id="inv-1", idempotency_key="k1")[0] == 201
    statements.clear()

    status, body = api.intent(invocation_id="inv-2", idempotency_key="k2", attempt_id="a1")

    assert (status, body["status"]) == (201, "in_flight")
    # The write alone: no read of the token, the capability or the invocation. The
    # write confirms the remembered token and capability (test_remembered_tokens.py).
    assert len(statements) == 1, statements
    assert statements[0].lstrip().startswith("WITH")
    assert Invocation.objects.get(invocation_id="inv-2").capability == refund


def test_a_replay_under_a_remembered_capability_is_read_and_answered_as_one(
    api: Api, refund: Capability
) -> None:
    first = api.intent(invocation_id="inv-1", attempt_id="a1")
    replay = api.intent(invocation_id="inv-1", attempt_id="a1")

    assert (first[0], replay[0]) == (201, 200)
    assert replay[1] == first[1]
    assert Event.objects.count() == 2


def test_a_capability_disabled_since_it_was_remembered_refuses(
    api: Api, refund: Capability
) -> None:
    assert api.intent(invocation_id="inv-1", idempotency_key="k1")[0] == 201
    # Behind the memory's back: no version change, no signal.
    Capability.objects.filter(pk=refund.pk).update(enabled=False)

    status, body = api.intent(invocation_id="inv-2", idempotency_key="k2")

    assert (status, body["error"]["type"]) == (422, "capability_disabled")
    assert not Invocation.objects.filter(invocation_id="inv-2").exists()


def test_a_capability_enabled_since_it_was_remembered_disabled_accepts(
    api: Api, refund: Capability
) -> None:
    Capability.objects.filter(pk=refund.pk).update(enabled=False)
    assert api.intent(invocation_id="inv-1", idempotency_key="k1")[0] == 422
    Capability.objects.filter(pk=refund.pk).update(enabled=True)

    status, _ = api.intent(invocation_id="inv-2", idempotency_key="k2")

    assert status == 201


def test_an_intent_takes_the_hints_the_capability_has_now(api: Api, refund: Capability) -> None:
    assert api.intent(invocation_id="inv-1", idempotency_key="k1")[0] == 201
    Capability.objects.filter(pk=refund.pk).update(readonly=True, timeout_ms=1234)

    assert api.intent(invocation_id="inv-2", idempotency_key="k2")[0] == 201

    invocation = Invocation.objects.get(invocation_id="inv-2")
    assert (invocation.hint_readonly, invocation.timeout_ms) == (True, 1234)


def test_a_capability_gone_since_it_was_remembered_makes_the_intent_undeclared(
    api: Api, refund: Capability
) -> None:
    assert api.intent(invocation_id="inv-1", idempotency_key="k1")[0] == 201
    Capability.objects.filter(pk=refund.pk).update(scope="refund.create.v0")

    status, body = api.intent(invocation_id="inv-2", idempotency_key="k2")

    assert (status, body["flags"]) == (201, ["undeclared"])
    assert Invocation.objects.get(invocation_id="inv-2").capability is None


def test_a_new_intent_under_a_scope_remembered_unregistered_is_one_write(
    api: Api, statements: list[str]
) -> None:
    """A deployment that has declared nothing yet pays no read for it on each intent."""
    assert api.intent(invocation_id="inv-1", idempotency_key="k1", capability="pay.new")[0] == 201
    statements.clear()

    status, body = api.intent(
        invocation_id="inv-2", idempotency_key="k2", capability="pay.new", attempt_id="a1"
    )

    assert (status, body["status"], body["flags"]) == (201, "in_flight", ["undeclared"])
    assert len(statements) == 1, statements
    invocation = Invocation.objects.get(invocation_id="inv-2")
    assert invocation.capability is None
    assert (invocation.hint_readonly, invocation.risk_level) == (False, "high")


def test_a_capability_registered_since_its_scope_was_remembered_unregistered_governs(
    api: Api,
) -> None:
    assert api.intent(invocation_id="inv-1", idempotency_key="k1", capability="pay.new")[0] == 201
    # Behind the memory's back, as another process's registration would be.
    registered("pay.new", enabled=False)

    status, body = api.intent(invocation_id="inv-2", idempotency_key="k2", capability="pay.new")

    assert (status, body["error"]["type"]) == (422, "capability_disabled")
    assert not Invocation.objects.filter(invocation_id="inv-2").exists()
    Capability.objects.filter(scope="pay.new").update(enabled=True, readonly=True)
    status, body = api.intent(invocation_id="inv-3", idempotency_key="k3", capability="pay.new")
    assert (status, body["flags"]) == (201, [])
    assert Invocation.objects.get(invocation_id="inv-3").hint_readonly is True


def test_only_the_scopes_read_last_are_remembered_unregistered(
    api: Api, statements: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runtimes name undeclared scopes: the memory of them stays bounded."""
    monkeypatch.setattr(store, "UNREGISTERED_REMEMBERED", 2)
    monkeypatch.setattr(store, "_unregistered", OrderedDict())  # none of earlier tests'
    for n, scope in enumerate(("pay.a", "pay.b", "pay.c")):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k{n}", capability=scope)
    assert len(store._unregistered) == 2

    sent = {}
    for n, scope in enumerate(("pay.c", "pay.a"), start=3):
        statements.clear()
        assert (
            api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k{n}", capability=scope)[0]
            == 201
        )
        sent[scope] = len(statements)
    assert sent == {"pay.c": 1, "pay.a": 2}  # forgotten: read, then written
