"""A web process does not read again a runtime token it has read: each request's own
statement confirms that the token is still unrevoked.

These tests revoke a remembered token behind the process's back, as `revoke_token`
run anywhere else would, and show that every kind of request then answers 401 and
writes nothing; the last does it with two gunicorn processes and a real command.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from django.core.management import call_command

from ledger import store
from ledger.api.authentication import RuntimeTokenAuthentication
from ledger.models import Attempt, Capability, Event, Invocation, Outcome, Runtime, RuntimeToken
from tests.conftest import ROOT, Api, intent_body, process_env


@pytest.fixture
def remembered(api: Api, refund: Capability) -> Api:
    """A runtime whose token this process has read, with inv-1's attempt a1 in flight."""
    RuntimeTokenAuthentication.remembered.clear()
    assert api.intent(invocation_id="inv-1", attempt_id="a1")[0] == 201
    assert RuntimeToken.split(api.token) in RuntimeTokenAuthentication.remembered
    return api


def recorded() -> tuple[int, ...]:
    return tuple(m.objects.count() for m in (Invocation, Attempt, Outcome, Event))


def test_a_remembered_token_is_confirmed_by_the_write_itself(
    remembered: Api, statements: list[str]
) -> None:
    status, _ = remembered.intent(invocation_id="inv-2", idempotency_key="k2")

    assert status == 201
    assert len(statements) == 1, statements  # no statement of its own for the token
    assert "ledger_assert_token_active" in statements[0]


REQUESTS: dict[str, Callable[[Api], tuple[int, Any]]] = {
    # A new intent under a remembered capability: the write is the only statement.
    "new intent": lambda api: api.intent(invocation_id="inv-2", idempotency_key="k2"),
    # A replay: read, and answered from what was read, without a write.
    "intent replay": lambda api: api.intent(invocation_id="inv-1", attempt_id="a1"),
    "attempt": lambda api: api.attempt("inv-1", "a2"),
    "outcome": lambda api: api.outcome("inv-1", "a1", kind="succeeded"),
    "batch": lambda api: api.post(
        "/api/v1/evidence",
        [{"type": "intent", **intent_body(invocation_id="inv-3", idempotency_key="k3")}],
    ),
    "invocation": lambda api: api.get("/api/v1/invocations/inv-1"),
    # Answered before any statement: the token is read before answering.
    "invalid body": lambda api: api.post("/api/v1/intents", {"invocation_id": 7}),
    "malformed path id": lambda api: api.get("/api/v1/invocations/bad%20id"),
    "batch of invalid items": lambda api: api.post("/api/v1/evidence", [{"type": "nope"}]),
}


@pytest.mark.parametrize("request_", REQUESTS.values(), ids=REQUESTS.keys())
def test_a_revoked_remembered_token_is_refused_and_writes_nothing(
    remembered: Api, request_: Callable[[Api], tuple[int, Any]]
) -> None:
    before = recorded()
    call_command("revoke_token", remembered.token)

    status, body = request_(remembered)

    assert (status, body["error"]["type"]) == (401, "unauthenticated")
    assert recorded() == before
    # Forgotten: the next request reads the token, and is refused before any work.
    assert RuntimeToken.split(remembered.token) not in RuntimeTokenAuthentication.remembered


def test_a_remembered_token_with_a_wrong_secret_is_refused(remembered: Api) -> None:
    forged = Api(remembered.client, remembered.token[:-4] + "AAAA")

    status, body = forged.intent(invocation_id="inv-2", idempotency_key="k2")

    assert (status, body["error"]["type"]) == (401, "unauthenticated")
    assert Invocation.objects.count() == 1


def test_a_deleted_token_counts_as_revoked(remembered: Api) -> None:
    RuntimeToken.objects.filter(prefix=RuntimeToken.split(remembered.token)).delete()

    status, _ = remembered.outcome("inv-1", "a1", kind="succeeded")

    assert status == 401
    assert Outcome.objects.count() == 0


def test_revoking_in_another_process_refuses_the_token_in_every_web_process(
    web_processes: list[str], refund: Capability
) -> None:
    _, token = RuntimeToken.issue(runtime=Runtime.objects.create(name="runtime-a"))
    headers = {"Authorization": f"Bearer {token}"}

    def intent(url: str, n: int) -> httpx.Response:
        body = intent_body(invocation_id=f"inv-{url[-5:]}-{n}", idempotency_key=f"{url}-{n}")
        return httpx.post(f"{url}/api/v1/intents", json=body, headers=headers)

    for url in web_processes:  # each process reads the token, then remembers it
        assert [intent(url, n).status_code for n in (1, 2)] == [201, 201]
    subprocess.run(
        [sys.executable, "manage.py", "revoke_token", token],
        cwd=ROOT,
        env=process_env(),
        check=True,
        capture_output=True,
    )

    for url in web_processes:
        refused = intent(url, 3)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["type"] == "unauthenticated"
    assert Invocation.objects.count() == 4
    assert store.active_token(RuntimeToken.split(token) or "") is None
