"""The asyncio runtime client against a live ledger (pytest's live server on PostgreSQL).

`AsyncLedgerClient` follows the same protocol module as `LedgerClient`, whose tests
cover each of the protocol's answers; these show that each kind of step (a request,
a pause before resending, the tool call, the spool) is done, and awaited, by the
async client, and what concurrency and cancellation on one event loop do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.client import (
    AsyncLedgerClient,
    BusinessFailure,
    CallContext,
)
from ledger.client.spool import Record, Spool
from ledger.models import Attempt, Invocation, Outcome
from tests.client.conftest import SlowDeliveries, TcpProxy
from tests.client.test_client import TRACEPARENT


class AsyncTool:
    """A business tool with an async client library: it awaits before it answers."""

    def __init__(self, behaviour: Any = None) -> None:
        self.calls: list[CallContext] = []
        self.behaviour = behaviour

    async def __call__(self, context: CallContext) -> Any:
        self.calls.append(context)
        await asyncio.sleep(0)  # the answer comes back through the event loop
        if isinstance(self.behaviour, BaseException):
            raise self.behaviour
        if callable(self.behaviour):
            return await self.behaviour(context)
        return {"id": f"RF-{len(self.calls)}"}


async def invoke(
    client: AsyncLedgerClient, tool: Callable[..., Any], key: str = "refund-SO-1"
) -> Any:
    return await client.invoke(
        task_id="task-1", capability="refund.create", arguments={"order": "SO-1"},
        idempotency_key=key, call=tool, reference=lambda v: v["id"],
    )  # fmt: skip


def run[T](journey: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """A journey on an event loop of its own (the database is asserted on outside it:
    Django's ORM refuses to run inside one)."""
    return asyncio.run(journey())


def test_an_async_tool_is_awaited_and_its_success_recorded(live_server: Any, token: str) -> None:
    tool = AsyncTool()

    async def journey() -> Any:
        async with AsyncLedgerClient(live_server.url, token) as client:
            return await client.invoke(
                task_id="task-1", capability="refund.create", arguments={"order": "SO-1"},
                idempotency_key="refund-SO-1", call=tool, traceparent=TRACEPARENT,
                reference=lambda v: v["id"], result=lambda v: {"refund": v["id"]},
            )  # fmt: skip

    result = run(journey)
    assert (result.kind, result.status, result.next_action) == ("succeeded", "succeeded", "none")
    assert (result.value, result.business_reference) == ({"id": "RF-1"}, "RF-1")
    assert tool.calls[0].idempotency_key == "refund-SO-1"
    outcome = Outcome.objects.select_related("attempt__invocation").get()
    assert (outcome.business_reference, outcome.result) == ("RF-1", {"refund": "RF-1"})
    assert outcome.attempt.invocation.traceparent == TRACEPARENT


def test_a_plain_function_is_a_tool_too(live_server: Any, token: str) -> None:
    calls: list[CallContext] = []

    def refund(context: CallContext) -> dict[str, str]:
        calls.append(context)
        return {"id": "RF-plain"}

    async def journey() -> Any:
        async with AsyncLedgerClient(live_server.url, token) as client:
            return await invoke(client, refund)

    assert run(journey).business_reference == "RF-plain"
    assert len(calls) == 1
    assert Outcome.objects.get().business_reference == "RF-plain"


def test_an_unknown_failure_is_never_retried_and_a_retryable_one_is(
    live_server: Any, token: str
) -> None:
    again = AsyncTool()

    async def journey() -> tuple[Any, Any, Any, Any]:
        async with AsyncLedgerClient(live_server.url, token) as client:
            lost = await invoke(client, AsyncTool(TimeoutError("no answer")), key="k-lost")
            refused = await client.retry(lost.invocation_id, again)
            busy = await invoke(client, AsyncTool(BusinessFailure("busy", retryable=True)))
            retried = await client.retry(busy.invocation_id, again, reference=lambda v: v["id"])
            return lost, refused, busy, retried

    lost, refused, busy, retried = run(journey)
    assert (lost.kind, lost.retryable, lost.reconciliation_required) == (
        "post_dispatch_evidence_failed",
        False,
        True,
    )
    assert (refused.kind, refused.reconciliation_required) == ("attempt_refused", True)
    assert (busy.kind, busy.next_action) == ("business_failed", "retry")
    assert (retried.kind, retried.attempt_id) == ("succeeded", "a2")
    # Called once, for the retryable failure's second attempt, under its key.
    assert [call.idempotency_key for call in again.calls] == ["refund-SO-1"]


class AllAtOnce:
    """A refund tool whose calls all wait until `count` of them have been admitted: it
    only returns if they run at the same time."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.admitted: list[str] = []
        self.all_admitted = asyncio.Event()

    async def __call__(self, context: CallContext) -> dict[str, str]:
        self.admitted.append(context.invocation_id)
        if len(self.admitted) == self.count:
            self.all_admitted.set()
        await self.all_admitted.wait()
        return {"id": f"RF-{context.idempotency_key}"}


def test_invocations_run_at_once_on_one_client_and_loop(live_server: Any, token: str) -> None:
    """Thirty invocations gathered on one client, their tools all waiting until every
    one has been admitted: each is admitted, called once and recorded."""
    refund = AllAtOnce(30)

    async def journey() -> list[Any]:
        async with AsyncLedgerClient(live_server.url, token) as client:
            calls = (invoke(client, refund, key=f"k-{n}") for n in range(refund.count))
            return list(await asyncio.wait_for(asyncio.gather(*calls), timeout=60))

    results = run(journey)
    assert sorted(result.business_reference for result in results) == sorted(
        f"RF-k-{n}" for n in range(refund.count)
    )
    assert len(set(refund.admitted)) == refund.count
    assert Outcome.objects.filter(kind="succeeded").count() == refund.count


def test_of_two_retries_at_once_only_the_admitted_one_calls(live_server: Any, token: str) -> None:
    tool = AsyncTool()

    async def journey() -> list[Any]:
        async with (
            AsyncLedgerClient(live_server.url, token) as one,
            AsyncLedgerClient(live_server.url, token) as other,
        ):
            busy = await invoke(one, AsyncTool(BusinessFailure("busy", retryable=True)))
            return list(
                await asyncio.gather(
                    one.retry(busy.invocation_id, tool), other.retry(busy.invocation_id, tool)
                )
            )

    kinds = sorted(result.kind for result in run(journey))
    assert len(tool.calls) == 1
    # The other asked for the same a2 (a 200 replay: in flight) or, once a2 had
    # succeeded, for a3 (refused).
    assert kinds[1] == "succeeded" and kinds[0] in ("attempt_in_flight", "attempt_refused")
    assert Attempt.objects.filter(outcome__isnull=False).count() == 2


def test_a_ledger_down_for_the_outcome_spools_it_and_an_awaited_flush_delivers_it(
    proxy: TcpProxy, token: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool.jsonl"

    async def refund_then_ledger_dies(context: CallContext) -> dict[str, str]:
        proxy.stop()
        return {"id": "RF-9"}

    async def down() -> Any:
        async with AsyncLedgerClient(proxy.url, token, spool=str(spool), retries=1) as client:
            return await invoke(client, AsyncTool(refund_then_ledger_dies))

    result = run(down)
    assert (result.kind, result.value) == ("post_dispatch_evidence_failed", {"id": "RF-9"})
    assert "kept in the spool" in result.error
    assert not Outcome.objects.exists()
    proxy.start()

    async def flushed() -> tuple[Any, Any]:
        async with AsyncLedgerClient(proxy.url, token, spool=str(spool)) as client:
            return await client.flush(), await client.flush()

    first, second = run(flushed)
    assert (first.delivered, first.remaining, first.damaged) == (1, 0, [])
    assert second.delivered == 0
    assert Outcome.objects.get().business_reference == "RF-9"
    assert Invocation.objects.get().status == "succeeded"


class UnavailableOnce(httpx.AsyncHTTPTransport):
    """Answers the first outcome report with the ledger's 503, as a database outage
    would; every other request goes to the live ledger."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/outcome") and 503 not in self.answered:
            self.answered.append(503)
            return httpx.Response(
                503, json={"error": {"type": "ledger_unavailable", "message": "", "details": {}}}
            )
        response = await super().handle_async_request(request)
        self.answered.append(response.status_code)
        return response


def test_an_outcome_refused_as_unavailable_is_awaited_and_sent_again(
    live_server: Any, token: str
) -> None:
    transport = UnavailableOnce()

    async def journey() -> Any:
        async with AsyncLedgerClient(live_server.url, token, transport=transport) as client:
            return await invoke(client, AsyncTool())

    result = run(journey)
    assert transport.answered == [201, 503, 201]
    assert (result.kind, result.status) == ("succeeded", "succeeded")
    assert Outcome.objects.get().kind == "succeeded"


def test_a_cancelled_invocation_without_a_spool_sends_its_outcome_on_its_own(
    live_server: Any, token: str
) -> None:
    """Cancelled while its tool ran, the caller's task ends at once, while the outcome
    saying so (the effect unknown) is still on its way: sent on its own, and awaited
    by the client's close."""
    started = asyncio.Event()
    stalled = StallsOutcomes()

    async def hangs(context: CallContext) -> None:
        started.set()
        await asyncio.Event().wait()

    async def journey() -> None:
        async with AsyncLedgerClient(live_server.url, token, transport=stalled) as client:
            task = asyncio.create_task(
                client.invoke(
                    task_id="task-1", capability="refund.create", arguments={},
                    idempotency_key="k-1", call=hangs, invocation_id="inv-cancelled",
                )
            )  # fmt: skip
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The caller is gone; the outcome has not been answered yet.
            assert (await client.state("inv-cancelled"))["status"] == "in_flight"
            stalled.release.set()

    run(journey)
    outcome = Outcome.objects.get()
    assert (outcome.kind, outcome.error_code) == ("post_dispatch_evidence_failed", "CancelledError")
    assert Invocation.objects.get().status == "reconciliation_required"


def test_a_cancelled_invocation_is_kept_as_unknown_and_delivered_after_the_next_call(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    """`asyncio.timeout` around the invocation, as a runtime bounds a tool it cannot
    bound itself: the task still ends at the timeout. That the call's effect is unknown,
    and why, is sent on its own and kept in the spool too, in case that send is lost;
    the client's next call delivers the spool (a replay)."""
    spool = tmp_path / "spool.jsonl"

    async def hangs(context: CallContext) -> None:
        await asyncio.Event().wait()

    async def journey() -> Any:
        async with AsyncLedgerClient(live_server.url, token, spool=str(spool)) as client:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1):
                    await invoke(client, hangs)
            assert len(client.spool.pending()) == 1  # type: ignore[union-attr]
            return await invoke(client, AsyncTool(), key="refund-SO-2")

    assert run(journey).kind == "succeeded"
    assert Spool(spool).pending() == []
    outcome = Outcome.objects.get(attempt__invocation__idempotency_key="refund-SO-1")
    assert (outcome.kind, outcome.error_code) == ("post_dispatch_evidence_failed", "CancelledError")
    assert "stopped waiting for the tool" in outcome.error_message
    invocation = outcome.attempt.invocation
    assert (invocation.status, invocation.cause) == (
        "reconciliation_required",
        "evidence_reported_lost",
    )


def test_a_cancelled_invocations_outcome_is_sent_though_the_client_is_never_closed(
    live_server: Any, token: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No spool, and the runtime returns without closing its client: the loop's
    shutdown cancels the outcome's send, which it then waits for, as a blocking
    client's exit does. Before, the send was cancelled and the attempt stayed in flight
    until the sweep flagged it."""

    async def hangs(context: CallContext) -> None:
        await asyncio.Event().wait()

    async def journey() -> None:
        client = AsyncLedgerClient(live_server.url, token)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1):
                await invoke(client, hangs)
        # Returns at once: the send has not had its answer yet.
        assert len(client._leaving) == 1

    run(journey)
    outcome = Outcome.objects.get()
    assert (outcome.kind, outcome.error_code) == ("post_dispatch_evidence_failed", "CancelledError")
    assert Invocation.objects.get().cause == "evidence_reported_lost"
    assert [r for r in caplog.records if r.name == "ledger.client"] == []


class StallsOutcomes(httpx.AsyncHTTPTransport):
    """The ledger does not answer an outcome report, as behind a stalled proxy, until
    the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/outcome"):
            await self.release.wait()
        return await super().handle_async_request(request)


def test_an_outcome_cancelled_on_its_way_is_kept_and_delivered_by_the_next_flush(
    live_server: Any, token: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The refund was made and its outcome is being sent when the caller's timeout
    cancels the task: the outcome the client knew is kept, not lost to the sweep. Sent
    again on its own, it stalls as well, and the client's close gives it up after one
    request's time (here 1 s) instead of waiting on it, saying so in the log."""
    spool = tmp_path / "spool.jsonl"

    async def journey() -> Any:
        stalled = AsyncLedgerClient(
            live_server.url, token, spool=str(spool), transport=StallsOutcomes(), timeout=1
        )
        async with stalled:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1):
                    await invoke(stalled, AsyncTool())
        async with AsyncLedgerClient(live_server.url, token, spool=str(spool)) as client:
            return await client.flush()

    report = run(journey)
    assert (report.delivered, report.remaining) == (1, 0)
    outcome = Outcome.objects.get()
    assert (outcome.kind, outcome.business_reference) == ("succeeded", "RF-1")
    assert Invocation.objects.get().status == "succeeded"
    warnings = [r.getMessage() for r in caplog.records if r.name == "ledger.client"]
    assert warnings == [
        f"outcome of an abandoned call not recorded (kept in the spool): "
        f"/api/v1/invocations/{outcome.attempt.invocation.invocation_id}/attempts/a1/outcome "
        "cancelled before the ledger answered"
    ]


def test_invocations_ending_together_deliver_the_spool_once(
    live_server: Any, token: str, slow_deliveries: SlowDeliveries
) -> None:
    """Ten invocations end at once while the spool holds a record: one delivers it, the
    others go on without waiting for the spool (each would hold a thread for it)."""
    refund = AllAtOnce(10)

    async def journey() -> list[Any]:
        spool = str(slow_deliveries.spool.path)
        async with AsyncLedgerClient(live_server.url, token, spool=spool) as client:
            calls = (invoke(client, refund, key=f"k-{n}") for n in range(refund.count))
            return list(await asyncio.gather(*calls))

    results = run(journey)
    assert {result.kind for result in results} == {"succeeded"}
    assert slow_deliveries.count == 1
    assert slow_deliveries.spool.pending() == []


def test_a_call_returns_before_the_spools_delivery_which_aclose_waits_for(
    live_server: Any, token: str, slow_deliveries: SlowDeliveries
) -> None:
    """The spool holds a record, and delivering it is slow (a slow disk): the call
    that sets its delivery off returns as soon as its own outcome is recorded, so
    neither the backlog nor a caller's timeout meant for the call comes between them;
    the delivery goes on in a task of its own, which aclose waits for."""

    async def journey() -> tuple[Any, int]:
        spool = str(slow_deliveries.spool.path)
        async with AsyncLedgerClient(live_server.url, token, spool=spool) as client:
            result = await invoke(client, AsyncTool())
            return result, len(slow_deliveries.spool.pending())

    result, pending_when_it_returned = run(journey)
    assert (result.kind, result.status) == ("succeeded", "succeeded")
    assert pending_when_it_returned == 1
    assert slow_deliveries.count == 1
    assert slow_deliveries.spool.pending() == []


def test_a_flush_abandoned_by_its_caller_lets_go_of_the_spool(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    """The ledger stalls on the record being delivered and the caller's timeout
    cancels the flush: its thread stops at that record, which stays spooled, and lets
    go of the spool (before, it waited on the stalled answer, holding the spool's lock,
    and the loop's shutdown waited on that thread)."""
    spool = Spool(tmp_path / "spool.jsonl")
    spool.append(Record("/api/v1/invocations/inv-x/attempts/a1/outcome", {"kind": "won"}))
    later = Record("/api/v1/invocations/inv-y/attempts/a1/outcome", {"kind": "won"})
    stalled = StallsOutcomes()

    async def journey() -> None:
        async with AsyncLedgerClient(
            live_server.url, token, spool=str(spool.path), transport=stalled
        ) as client:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1):
                    await client.flush()
            try:
                # The spool's lock is free again: an outcome can still be kept.
                await asyncio.wait_for(asyncio.to_thread(spool.append, later), timeout=20)
            finally:
                stalled.release.set()

    run(journey)
    assert [record.body for record in spool.pending()] == [{"kind": "won"}, {"kind": "won"}]


class RefusesOutcomes(httpx.AsyncHTTPTransport):
    """The ledger cannot be reached for outcome reports; every other request goes to it."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/outcome"):
            raise httpx.ConnectError("connection refused", request=request)
        return await super().handle_async_request(request)


def test_an_abandoned_calls_outcome_lost_on_its_way_stays_in_the_spool(
    live_server: Any, token: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The outcome sent on its own after a cancellation does not reach the ledger: the
    spool still holds it, and the log says so."""
    spool = Spool(tmp_path / "spool.jsonl")

    async def hangs(context: CallContext) -> None:
        await asyncio.Event().wait()

    async def journey() -> None:
        async with AsyncLedgerClient(
            live_server.url, token, spool=str(spool.path), transport=RefusesOutcomes(), retries=0
        ) as client:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1):
                    await invoke(client, hangs)

    run(journey)
    assert [record.body["error"]["code"] for record in spool.pending()] == ["CancelledError"]
    assert not Outcome.objects.exists()
    warnings = [r.getMessage() for r in caplog.records if r.name == "ledger.client"]
    assert len(warnings) == 1
    assert warnings[0].startswith("outcome of an abandoned call not recorded (kept in the spool)")
