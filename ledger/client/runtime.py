"""The runtime side of the write-ahead protocol, for any Python agent runtime.

    ledger = LedgerClient("https://ledger.internal", token, spool="/var/lib/agent/spool")
    result = ledger.invoke(
        task_id="ticket-81",
        capability="refund.create",
        arguments={"order": "SO-1", "amount": "12.50"},
        idempotency_key="refund-SO-1",
        call=lambda ctx: payments.refund("SO-1", "12.50", idempotency_key=ctx.idempotency_key),
    )
    if result.kind == "succeeded": ...
    elif result.reconciliation_required: ...   # never retry this yourself

The tool is called only after the ledger admitted the attempt, in answer to this
very request (201): an admission replayed (200), as after a crash or when another
process won the same attempt id, may already have been dispatched, so it is left to
its outcome or to reconciliation (`attempt_in_flight`). An exception from
the tool is an outcome, not a crash: `BusinessFailure` → business_failed,
`NotDispatched` → pre_dispatch_rejected, `DispatchNotEstablished` →
dispatch_not_established, anything else → post_dispatch_evidence_failed. An outcome
the ledger cannot take (down, rate-limited past the retries, or answered for by a
proxy's error page) is kept in the durable spool, delivered after the next call the
ledger answers or by `flush()`; the caller then gets `post_dispatch_evidence_failed`,
never a generic error.

`AsyncLedgerClient` is the same for asyncio runtimes: its methods are awaited, and
its tool may be a coroutine function. Both follow `ledger.client.protocol`, which
holds the protocol once for the two.

Depends on httpx only (no Django): this package can be copied or vendored alone.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from ledger.client.protocol import (
    BusinessFailure,
    CallContext,
    Dispatch,
    DispatchNotEstablished,
    InvocationResult,
    Keep,
    Leave,
    LedgerRequestError,
    LedgerUnreachable,
    NotDispatched,
    Pause,
    Protocol,
    Send,
    Step,
    Steps,
    Tool,
)
from ledger.client.spool import FlushReport, Record, Refused, Spool

__all__ = [
    "AsyncLedgerClient",
    "BusinessFailure",
    "CallContext",
    "DispatchNotEstablished",
    "InvocationResult",
    "LedgerClient",
    "LedgerRequestError",
    "LedgerUnreachable",
    "NotDispatched",
]


log = logging.getLogger("ledger.client")

# The most records delivered after one call: the call waits for them, so a spool
# filled by a long outage is delivered a part at a time, by the calls after it.
AUTO_FLUSH_RECORDS = 100
# How soon an async flush's thread notices that its caller abandoned it.
ABANDON_POLL_SECONDS = 0.1


def _delivery_due(spool: Spool | None, answered: InvocationResult) -> bool:
    """Whether the spool is delivered after a call (with `auto_flush`, the default):
    when it holds records and the ledger has just answered (the call's state came from
    it), so that a runtime that never calls `flush` still delivers what an outage or a
    cancelled call left there."""
    return spool is not None and answered.status is not None and spool.holds_records()


def _report_delivery(report: FlushReport) -> None:
    """What a delivery nobody asked for did, in the log: its report has no caller. A
    record set aside, or one the ledger would not take now, is a warning."""
    trouble = report.damaged or report.refused or report.stopped_by
    level = logging.WARNING if trouble else logging.INFO
    log.log(
        level,
        "spool delivered=%d remaining=%d damaged=%d refused=%d stopped_by=%s",
        report.delivered, report.remaining, len(report.damaged), len(report.refused),
        report.stopped_by,
    )  # fmt: skip


def _report_left(record: Record, why: str | Refused | None, spooled: bool) -> None:
    """The end of an abandoned call's outcome sent on its own (`Leave`): logged only
    when the ledger did not record it, since nobody waits for its answer."""
    if why is not None:
        kept = "kept in the spool" if spooled else "no spool configured"
        log.warning("outcome of an abandoned call not recorded (%s): %s %s", kept, record.path, why)


# Blocking clients' threads still sending the outcome of an abandoned call (`Leave`),
# each with its client's timeout: a runtime stopped by Ctrl-C exits once they are done,
# or once that time has passed, whether or not it closed its client.
_leaving_at_exit: dict[threading.Thread, float] = {}


def _wait_for_leaving(leaving: Mapping[threading.Thread, float]) -> None:
    """Each sender given its client's timeout from now, at most (a spooled outcome
    stays kept if it is cut short)."""
    started = time.monotonic()
    for thread, seconds in list(leaving.items()):
        thread.join(max(0.0, started + seconds - time.monotonic()))


atexit.register(_wait_for_leaving, _leaving_at_exit)


def _http_options(url: str, token: str, timeout: float) -> dict[str, Any]:
    return {
        "base_url": url,
        "headers": {"Authorization": f"Bearer {token}"},
        "timeout": timeout,
        "limits": httpx.Limits(max_keepalive_connections=8),
    }


class LedgerClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        spool: str | None = None,
        timeout: float = 5.0,
        retries: int = 3,
        auto_flush: bool = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.http = httpx.Client(**_http_options(url, token, timeout), transport=transport)
        self.timeout = timeout
        self.spool = Spool(spool) if spool else None
        self.protocol = Protocol(retries=retries, spooled=self.spool is not None)
        self.auto_flush = auto_flush
        # Held by the thread delivering after its call: the others go on, not queue.
        self._delivering = threading.Lock()
        # Outcomes of abandoned calls on their way (`Leave`), waited for by close.
        self._leaving: dict[threading.Thread, float] = {}

    def close(self) -> None:
        _wait_for_leaving(self._leaving)
        self.http.close()

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """The ledger's typed answer (status and JSON body), resending what it did not
        take (`Protocol.requested` says what is resent)."""
        return self._run(self.protocol.requested(method, path, body))

    def invoke(
        self,
        *,
        task_id: str,
        capability: str,
        arguments: Any,
        idempotency_key: str,
        call: Callable[[CallContext], Any],
        subject: str = "",
        approval: Mapping[str, Any] | None = None,
        invocation_id: str | None = None,
        traceparent: str = "",
        reference: Callable[[Any], str] | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> InvocationResult:
        """Intent with the first attempt, the call if admitted, then the outcome."""
        answered = self._run(
            self.protocol.invoked(
                task_id=task_id, capability=capability, arguments=arguments,
                idempotency_key=idempotency_key, tool=Tool(call, reference, result),
                subject=subject, approval=approval, traceparent=traceparent,
                invocation_id=invocation_id or f"inv-{uuid.uuid4().hex}",
            )
        )  # fmt: skip
        self._deliver_spooled(answered)
        return answered

    def retry(
        self,
        invocation_id: str,
        call: Callable[[CallContext], Any],
        *,
        reference: Callable[[Any], str] | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> InvocationResult:
        """A new attempt under the same ids and key, only if the ledger admits it.

        After an intent the ledger did not confirm, this sends that intent again."""
        answered = self._run(self.protocol.retried(invocation_id, Tool(call, reference, result)))
        self._deliver_spooled(answered)
        return answered

    def state(self, invocation_id: str) -> dict[str, Any]:
        """The ledger's record of an invocation: its typed state, attempts and events."""
        return self._run(self.protocol.state(invocation_id))

    def flush(self, most: int | None = None) -> FlushReport:
        """Deliver spooled outcomes in order (the first `most`); replays are harmless.

        Delivery stops, keeping every record, when the ledger is unreachable or refuses
        the caller (a revoked token, or another runtime's: 401, 403, 404), since a
        later flush with the right token delivers them. A record refused as invalid
        (400, 413, 422) can never be taken and is set aside in `<spool>.refused`.
        """
        return self._flush(most)

    def _flush(self, most: int | None, until: float | None = None) -> FlushReport:
        if self.spool is None:
            return FlushReport()

        def send(record: Record) -> str | Refused | None:
            return self._run(self.protocol.delivered(record))

        return self.spool.deliver(send, most, until)

    def _deliver_spooled(self, answered: InvocationResult) -> None:
        """The spool delivered after a call, which waits for it: 100 records at most,
        and none begun once the client's timeout has passed, so a slow ledger delays
        the call's answer by about one request's time, not a hundred."""
        if not (self.auto_flush and _delivery_due(self.spool, answered)):
            return
        if not self._delivering.acquire(blocking=False):
            return
        try:
            _report_delivery(self._flush(AUTO_FLUSH_RECORDS, time.monotonic() + self.timeout))
        except Exception:  # the call's own result stands; the records stay spooled
            log.exception("spool delivery failed")
        finally:
            self._delivering.release()

    def _dispatch(
        self,
        context: CallContext,
        task_id: str,
        call: Callable[[CallContext], Any],
        reference: Callable[[Any], str] | None,
    ) -> InvocationResult:
        return self._run(self.protocol.dispatched(context, task_id, Tool(call, reference)))

    def _run[T](self, steps: Steps[T]) -> T:
        """The protocol's steps done one after the other, each one's answer (or its
        exception) given back to the protocol, until it returns."""
        answer: Any = None
        failure: BaseException | None = None
        while True:
            try:
                step = steps.send(answer) if failure is None else steps.throw(failure)
            except StopIteration as done:
                return done.value
            answer, failure = None, None
            try:
                answer = self._do(step)
            except BaseException as exc:  # a KeyboardInterrupt too: the protocol keeps
                failure = exc  # what it knows of the call, then raises it on

    def _do(self, step: Step) -> Any:
        match step:
            case Send(method, path, body):
                return self.http.request(method, path, json=body)
            case Pause(seconds):
                time.sleep(seconds)
            case Dispatch(call, context):
                return call(context)
            case Keep(record):
                assert self.spool is not None
                self.spool.append(record)
            case Leave(record):
                # A thread of its own: the caller stops now, and the process waits for
                # the send (one request's time at most) as it exits.
                sending = threading.Thread(
                    target=self._left, args=(record,), name="ledger-abandoned-outcome",
                    daemon=True,
                )  # fmt: skip
                self._leaving[sending] = _leaving_at_exit[sending] = self.timeout
                sending.start()
        return None

    def _left(self, record: Record) -> None:
        why: str | Refused | None
        try:
            why = self._run(self.protocol.delivered(record))
        except Exception as exc:  # the client closed under it, after close gave up waiting
            why = f"{type(exc).__name__}: {exc}"
        _report_left(record, why, bool(self.spool))  # before the exit stops waiting for it
        current = threading.current_thread()
        self._leaving.pop(current, None)
        _leaving_at_exit.pop(current, None)


class AsyncLedgerClient:
    """`LedgerClient` for asyncio runtimes. The tool may be a coroutine function (its
    coroutine is awaited) or a plain one, which runs on the event loop: give a tool
    that blocks to `asyncio.to_thread` inside it. Spool writes and flushes run in a
    thread, so that their fsyncs do not hold the loop.

    One client serves any number of invocations at once on its loop. A task cancelled
    while its tool runs (by `asyncio.timeout` around `invoke`, say) ends without
    waiting for the ledger: the outcome saying so is sent in a task of its own, which
    `aclose`, or the loop's shutdown for a client never closed, waits for (and kept in
    the spool, if there is one). A TimeoutError raised inside the tool, by a bound on
    its own wait, is an outcome like any other.

    The spool's automatic delivery runs in a task of its own as well: a call returns
    as soon as its outcome is recorded, so neither the spool's backlog nor a caller's
    timeout meant for the call comes between the two."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        spool: str | None = None,
        timeout: float = 5.0,
        retries: int = 3,
        auto_flush: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.http = httpx.AsyncClient(**_http_options(url, token, timeout), transport=transport)
        self.timeout = timeout
        self.spool = Spool(spool) if spool else None
        self.protocol = Protocol(retries=retries, spooled=self.spool is not None)
        self.auto_flush = auto_flush
        # The spool's automatic delivery under way, and the outcomes of abandoned calls
        # on their way (`Leave`): tasks of their own, which aclose waits for.
        self._delivering: asyncio.Task[None] | None = None
        self._leaving: set[asyncio.Task[None]] = set()
        # Set by aclose before it gives up on what it waited for: an abandoned call's
        # send cancelled otherwise is cancelled by the loop's shutdown.
        self._closing = False

    async def aclose(self) -> None:
        self._closing = True
        running = {*self._leaving, *([self._delivering] if self._delivering else [])}
        if running:
            # Given one request's time, then given up: a cancelled delivery stops at the
            # record it was sending, and an abandoned call's spooled outcome is kept.
            _, late = await asyncio.wait(running, timeout=self.timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.http.aclose()

    async def __aenter__(self) -> AsyncLedgerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """`LedgerClient.request`, awaited."""
        return await self._run(self.protocol.requested(method, path, body))

    async def invoke(
        self,
        *,
        task_id: str,
        capability: str,
        arguments: Any,
        idempotency_key: str,
        call: Callable[[CallContext], Awaitable[Any] | Any],
        subject: str = "",
        approval: Mapping[str, Any] | None = None,
        invocation_id: str | None = None,
        traceparent: str = "",
        reference: Callable[[Any], str] | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> InvocationResult:
        """`LedgerClient.invoke`, awaited: intent with the first attempt, the call if
        admitted, then the outcome."""
        answered = await self._run(
            self.protocol.invoked(
                task_id=task_id, capability=capability, arguments=arguments,
                idempotency_key=idempotency_key, tool=Tool(call, reference, result),
                subject=subject, approval=approval, traceparent=traceparent,
                invocation_id=invocation_id or f"inv-{uuid.uuid4().hex}",
            )
        )  # fmt: skip
        self._deliver_spooled(answered)
        return answered

    async def retry(
        self,
        invocation_id: str,
        call: Callable[[CallContext], Awaitable[Any] | Any],
        *,
        reference: Callable[[Any], str] | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> InvocationResult:
        """`LedgerClient.retry`, awaited."""
        tool = Tool(call, reference, result)
        answered = await self._run(self.protocol.retried(invocation_id, tool))
        self._deliver_spooled(answered)
        return answered

    async def state(self, invocation_id: str) -> dict[str, Any]:
        """`LedgerClient.state`, awaited."""
        return await self._run(self.protocol.state(invocation_id))

    async def flush(self, most: int | None = None) -> FlushReport:
        """`LedgerClient.flush`, awaited. The spool is read and rewritten in a thread,
        which has each record sent by this loop."""
        if self.spool is None:
            return FlushReport()
        loop = asyncio.get_running_loop()
        abandoned = threading.Event()

        def send(record: Record) -> str | Refused | None:
            sent = asyncio.run_coroutine_threadsafe(
                self._run(self.protocol.delivered(record)), loop
            )
            # Waited for in short turns: a flush its caller abandoned (cancelled, or its
            # loop shutting down) stops at this record, which stays spooled, instead of
            # holding the spool's lock and its thread (and so the loop's shutdown) for an
            # answer the loop may never run.
            while not abandoned.is_set():
                try:
                    return sent.result(timeout=ABANDON_POLL_SECONDS)
                except TimeoutError:
                    if sent.done():
                        raise
            sent.cancel()
            return "the flush was abandoned by its caller"

        try:
            return await asyncio.to_thread(self.spool.deliver, send, most)
        except BaseException:
            abandoned.set()
            raise

    def _deliver_spooled(self, answered: InvocationResult) -> None:
        """`LedgerClient._deliver_spooled`, in a task of its own that the call does not
        wait for; one at a time on the loop, so that invocations ending together do not
        each hold a thread waiting for the spool."""
        if self._delivering or not (self.auto_flush and _delivery_due(self.spool, answered)):
            return
        self._delivering = asyncio.create_task(self._deliver())

    async def _deliver(self) -> None:
        try:
            _report_delivery(await self.flush(AUTO_FLUSH_RECORDS))
        except Exception:
            log.exception("spool delivery failed")
        finally:
            self._delivering = None

    async def _run[T](self, steps: Steps[T]) -> T:
        """`LedgerClient._run`, with each step awaited."""
        answer: Any = None
        failure: BaseException | None = None
        while True:
            try:
                step = steps.send(answer) if failure is None else steps.throw(failure)
            except StopIteration as done:
                return done.value
            answer, failure = None, None
            try:
                answer = await self._do(step)
            except BaseException as exc:  # the task's cancellation too, as above
                failure = exc

    async def _do(self, step: Step) -> Any:
        match step:
            case Send(method, path, body):
                return await self.http.request(method, path, json=body)
            case Pause(seconds):
                await asyncio.sleep(seconds)
            case Dispatch(call, context):
                value = call(context)
                return await value if inspect.isawaitable(value) else value
            case Keep(record):
                assert self.spool is not None
                await asyncio.to_thread(self.spool.append, record)
            case Leave(record):
                # A task of its own, which the caller's cancellation does not reach.
                sending = asyncio.create_task(self._left(record))
                self._leaving.add(sending)
                sending.add_done_callback(self._leaving.discard)
        return None

    async def _left(self, record: Record) -> None:
        why: str | Refused | None
        try:
            why = await self._run(self.protocol.delivered(record))
        except asyncio.CancelledError:
            if self._closing:
                # By aclose, after one request's time: the log still tells that the
                # ledger may not have it.
                _report_left(record, "cancelled before the ledger answered", bool(self.spool))
                raise
            why = await self._left_at_shutdown(record)
        except Exception as exc:  # the client closed under it, as in LedgerClient._left
            why = f"{type(exc).__name__}: {exc}"
        _report_left(record, why, bool(self.spool))

    async def _left_at_shutdown(self, record: Record) -> str | Refused | None:
        """The send cancelled by the loop's shutdown, for a client never closed: the
        loop waits for the tasks it cancels, so the outcome is sent again, given one
        request's time as a blocking client's exit gives it (a replay, if the first
        send reached the ledger)."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._run(self.protocol.delivered(record))
        except TimeoutError:
            return "cancelled by the loop's shutdown, and not answered within the timeout"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
