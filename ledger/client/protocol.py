"""The runtime side of the write-ahead protocol, without its input and output.

Each part of the protocol is a generator that yields the step it needs done (a request
to the ledger, a pause before resending one, the tool call, an outcome kept in the
spool) and is sent that step's answer, or has its exception thrown in. `LedgerClient`
does the steps with blocking calls, `AsyncLedgerClient` with awaits: one text of the
protocol for both, so that the two cannot come to disagree about when a tool may be
called. (The "sans-I/O" pattern of h11 and hyper-h2.)

Depends on httpx only for its response and error types.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from ledger.client.spool import Record, Refused


class BusinessFailure(Exception):
    """Raise from a tool when the business system refused or rolled back."""

    def __init__(self, code: str, message: str = "", *, retryable: bool = False) -> None:
        super().__init__(message or code)
        self.code, self.message, self.retryable = code, message, retryable


class NotDispatched(Exception):
    """Raise from a tool when the request certainly never left the runtime."""


class DispatchNotEstablished(Exception):
    """Raise from a tool when it cannot tell whether the request was sent."""


class LedgerUnreachable(Exception):
    """The ledger did not answer (after the retries that are safe)."""


class LedgerRequestError(Exception):
    """The ledger refused a request as malformed or conflicting: a bug to fix."""

    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, Mapping) else {}
        super().__init__(f"{status} {error.get('type')}: {error.get('message')}")
        self.status, self.type, self.body = status, error.get("type"), body
        self.details: dict[str, Any] = error.get("details") or {}


@dataclass(frozen=True)
class CallContext:
    """What the tool call needs to pass to the business system."""

    invocation_id: str
    attempt_id: str
    idempotency_key: str


@dataclass(frozen=True)
class InvocationResult:
    kind: str  # an outcome kind, or attempt_refused / attempt_in_flight
    invocation_id: str
    attempt_id: str | None
    task_id: str
    status: str | None
    retryable: bool
    reconciliation_required: bool
    next_action: str
    value: Any = None
    business_reference: str = ""
    error: str = ""
    flags: list[str] = field(default_factory=list)


# The steps a client does for the protocol --------------------------------------


@dataclass(frozen=True)
class Send:
    """A request to the ledger: answered with its `httpx.Response`, or the httpx
    error thrown in."""

    method: str
    path: str
    body: Any = None


@dataclass(frozen=True)
class Pause:
    """A wait before a request is sent again."""

    seconds: float


@dataclass(frozen=True)
class Dispatch:
    """The tool call: answered with what it returned, or its exception thrown in.
    An async client awaits what a coroutine function returns."""

    call: Callable[[CallContext], Any]
    context: CallContext


@dataclass(frozen=True)
class Keep:
    """An outcome appended to the spool, durably, before the step is answered."""

    record: Record


@dataclass(frozen=True)
class Leave:
    """An outcome sent on its own, after the caller has gone: nobody waits for it (a
    task of the async client's, a thread of the blocking one's)."""

    record: Record


type Step = Send | Pause | Dispatch | Keep | Leave
type Steps[T] = Generator[Step, Any, T]


@dataclass(frozen=True)
class Tool:
    """The business call, and what of its answer the outcome records."""

    call: Callable[[CallContext], Any]
    # The business system's id of the effect: the outcome's `business_reference`.
    reference: Callable[[Any], str] | None = None
    # Any JSON: the outcome's `result` (digested, and redacted for an `audit.sensitive`
    # capability).
    result: Callable[[Any], Any] | None = None


def not_dispatched(invocation_id: str, task_id: str, why: str) -> InvocationResult:
    """The ledger did not confirm an admission: the tool was not called, try again."""
    return InvocationResult(
        "pre_dispatch_rejected", invocation_id, None, task_id, None,
        retryable=True, reconciliation_required=False, next_action="retry", error=why,
    )  # fmt: skip


# The ledger refused the caller rather than the request (a revoked token, or another
# runtime's): an outcome is kept for a flush with the right token, never dropped.
CALLER_REFUSED = (401, 403, 404)

# Seconds: an answer that asks for a longer wait is not resent (the caller had better
# decide itself), but told as the ledger not taking the request now.
MAX_RETRY_AFTER = 10.0


def _ledger_json(response: httpx.Response) -> Any:
    """The body when it is the ledger's JSON object, else None."""
    if not response.headers.get("content-type", "").startswith("application/json"):
        return None
    try:
        payload = response.json()
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def _retry_after(response: httpx.Response) -> float:
    try:
        seconds = float(response.headers.get("retry-after", 0))
    except ValueError:  # an HTTP date: the ledger never sends one
        return 0.0
    return seconds if seconds > 0 else 0.0  # NaN is not > 0


class Protocol:
    """The protocol as one runtime client follows it: how often it resends, whether it
    has a spool, and the intents it sent that the ledger did not confirm."""

    def __init__(self, *, retries: int, spooled: bool) -> None:
        self.retries = retries
        self.spooled = spooled
        # Intents sent but not confirmed, by invocation_id, for `retried` to send again.
        self.unconfirmed: dict[str, dict[str, Any]] = {}

    def requested(self, method: str, path: str, body: Any = None) -> Steps[tuple[int, Any]]:
        """The ledger's typed answer (status and JSON body), resending what it did not
        take.

        Resent, after the answer's Retry-After if it gives one: a 429 `rate_limited`, any
        5xx (`ledger_unavailable`, `internal_error`, `projection_broken`, a proxy's 502
        page), an answer that is not the ledger's JSON, a connection refused before
        anything was sent, and one closed before the answer came whole (a web process
        killed mid-request, a keep-alive connection the server closed as it was
        reused): every call of this API replays safely, and a resent admission that had
        in fact been recorded comes back as a 200 replay, which `refusal` never
        dispatches. Not resent: a timeout (the ledger may still be
        at work on the request, and the caller has waited long enough), and an answer
        asking for a wait over MAX_RETRY_AFTER (a capability's enforced rate limit: an
        hour's window may ask for most of an hour).
        """
        for attempt in range(self.retries + 1):
            wait = 0.2 * 2**attempt
            try:
                response = yield Send(method, path, body)
            except httpx.ConnectError as exc:
                last = f"connection failed: {exc}"
            except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                last = f"connection closed before the answer: {type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                raise LedgerUnreachable(f"{type(exc).__name__}: {exc}") from exc
            else:
                payload = _ledger_json(response)
                if payload is None:
                    last = f"{response.status_code} without an answer from the ledger"
                elif response.status_code != 429 and response.status_code < 500:
                    return response.status_code, payload
                else:
                    last = payload.get("error", {}).get("type") or str(response.status_code)
                    asked = _retry_after(response)
                    if asked > MAX_RETRY_AFTER:  # a capability's rate limit, say
                        raise LedgerUnreachable(f"{last}: retry after {asked:g} s")
                    wait = max(wait, asked)
            if attempt < self.retries:
                yield Pause(wait)
        raise LedgerUnreachable(last)

    def invoked(
        self,
        *,
        task_id: str,
        capability: str,
        arguments: Any,
        idempotency_key: str,
        tool: Tool,
        subject: str,
        approval: Mapping[str, Any] | None,
        invocation_id: str,
        traceparent: str,
    ) -> Steps[InvocationResult]:
        """Intent with the first attempt, the call if admitted, then the outcome."""
        intent: dict[str, Any] = {
            "invocation_id": invocation_id,
            "task_id": task_id,
            "capability": capability,
            "arguments": arguments,
            "idempotency_key": idempotency_key,
            "attempt_id": "a1",
            # The runtime's clock, kept beside the ledger's (which is the one relied on).
            "requested_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        if traceparent:
            intent["traceparent"] = traceparent
        if subject:
            intent["subject"] = subject
        if approval:
            intent["approval"] = dict(approval)
        return (yield from self._written_ahead(intent, tool))

    def retried(self, invocation_id: str, tool: Tool) -> Steps[InvocationResult]:
        """A new attempt under the same ids and key, only if the ledger admits it.

        After an intent the ledger did not confirm, this sends that intent again."""
        if invocation_id in self.unconfirmed:
            intent = self.unconfirmed[invocation_id]
            return (yield from self._written_ahead(intent, tool))
        try:
            current = yield from self.state(invocation_id)
            attempt_id = f"a{len(current['attempts']) + 1}"
            status, body = yield from self.requested(
                "POST", f"/api/v1/invocations/{invocation_id}/attempts", {"attempt_id": attempt_id}
            )
        except LedgerUnreachable as exc:
            # An admission whose answer was lost stays in flight: the next retry asks for
            # the attempt after it and is refused, so the tool is never called for it.
            return not_dispatched(invocation_id, "", f"attempt not confirmed: {exc}")
        refused = refusal(status, body, invocation_id, attempt_id, current["task_id"])
        if refused:
            return refused
        context = CallContext(invocation_id, attempt_id, current["idempotency_key"])
        return (yield from self.dispatched(context, current["task_id"], tool))

    def state(self, invocation_id: str) -> Steps[dict[str, Any]]:
        """The ledger's record of an invocation: its typed state, attempts and events."""
        status, body = yield from self.requested("GET", f"/api/v1/invocations/{invocation_id}")
        if status != 200:
            raise LedgerRequestError(status, body)
        return dict(body)

    def _written_ahead(self, intent: dict[str, Any], tool: Tool) -> Steps[InvocationResult]:
        invocation_id, task_id = intent["invocation_id"], intent["task_id"]
        try:
            status, body = yield from self.requested("POST", "/api/v1/intents", intent)
        except LedgerUnreachable as exc:
            # The intent may have been recorded all the same (an answer lost on its way
            # back), binding the key to this invocation_id: `retried` sends it again.
            self.unconfirmed[invocation_id] = intent
            return not_dispatched(invocation_id, task_id, f"intent not confirmed: {exc}")
        self.unconfirmed.pop(invocation_id, None)
        refused = refusal(status, body, invocation_id, intent["attempt_id"], task_id)
        if refused:
            return refused
        context = CallContext(invocation_id, intent["attempt_id"], intent["idempotency_key"])
        return (yield from self.dispatched(context, task_id, tool))

    def dispatched(self, context: CallContext, task_id: str, tool: Tool) -> Steps[InvocationResult]:
        """The tool called for an admitted attempt, and its outcome recorded (or kept).

        An `Exception` from the tool is an outcome, sent at once. Anything else
        (KeyboardInterrupt, SystemExit, an asyncio task's cancellation) is the caller
        abandoning the call: it ends at once, with no request sent while the caller
        waits to stop. What is known (that the effect is unknown, or the outcome that
        was being sent) is sent on its own (`Leave`), and kept in the spool for the next
        delivery in case that send is lost. Lost and unspooled, the attempt stays in
        flight until its deadline, when the ledger's sweep hands it to reconciliation,
        as it does when a runtime dies mid-call."""
        path = f"/api/v1/invocations/{context.invocation_id}/attempts/{context.attempt_id}/outcome"
        value, error = None, ""
        outcome: dict[str, Any]
        try:
            value = yield Dispatch(tool.call, context)
            business_reference = tool.reference(value) if tool.reference else ""
            outcome = {"kind": "succeeded"}
            if business_reference:
                outcome["business_reference"] = business_reference
            if tool.result is not None:
                # Checked here, not by the request: evidence that is not JSON is the
                # evidence failing, told as such, after a call that may have had effect.
                outcome["result"] = json.loads(json.dumps(tool.result(value), allow_nan=False))
        except BusinessFailure as failure:
            error = failure.message or failure.code
            outcome = {
                "kind": "business_failed",
                "retryable": failure.retryable,
                "error": {"code": failure.code[:128]},
            }
            if failure.message:
                outcome["error"]["message"] = failure.message[:4000]
        except NotDispatched as exc:
            error, outcome = str(exc), {"kind": "pre_dispatch_rejected"}
        except DispatchNotEstablished as exc:
            error, outcome = str(exc), {"kind": "dispatch_not_established"}
        except Exception as exc:  # the effect may have happened: never a blind retry
            error = f"{type(exc).__name__}: {exc}"
            outcome = {
                "kind": "post_dispatch_evidence_failed",
                "error": {"code": type(exc).__name__},
            }
            if str(exc):
                outcome["error"]["message"] = str(exc)[:4000]
        except GeneratorExit:  # the protocol itself closed, not the call
            raise
        except BaseException as abandoned:
            yield from self._abandoned(Record(path, abandoned_outcome(abandoned)))
            raise
        try:
            status, body = yield from self.requested("POST", path, outcome)
        except LedgerUnreachable as exc:
            return (
                yield from self._kept(
                    context, task_id, path, outcome, value, f"not recorded ({exc})"
                )
            )
        except GeneratorExit:
            raise
        except BaseException:  # abandoned while the outcome was sent: a replay is harmless
            yield from self._abandoned(Record(path, outcome))
            raise
        if status in CALLER_REFUSED:
            # A token revoked or rotated while the tool ran: a flush with the new one
            # delivers the outcome.
            error = body.get("error", {})
            why = f"refused for this client ({status} {error.get('type')})"
            return (yield from self._kept(context, task_id, path, outcome, value, why))
        if status not in (200, 201):
            raise LedgerRequestError(status, body)
        return InvocationResult(
            outcome["kind"], context.invocation_id, context.attempt_id, task_id,
            body["status"], retryable=body["retryable"],
            reconciliation_required=body["reconciliation_required"],
            next_action=body["next_action"], value=value,
            business_reference=outcome.get("business_reference", ""), error=error,
            flags=body["flags"],
        )  # fmt: skip

    def _abandoned(self, record: Record) -> Steps[None]:
        """What is known of a call its caller abandoned, without a request the caller
        would wait for: kept in the spool, in case it is lost, and sent on its own."""
        if self.spooled:
            yield Keep(record)
        yield Leave(record)

    def _kept(
        self,
        context: CallContext,
        task_id: str,
        path: str,
        outcome: dict[str, Any],
        value: Any,
        why: str,
    ) -> Steps[InvocationResult]:
        """An outcome the ledger did not record: spooled, and the caller told that the
        effect's evidence is missing, which only reconciliation may settle."""
        kept = "no spool configured"
        if self.spooled:
            yield Keep(Record(path, outcome))
            kept = "kept in the spool"
        return InvocationResult(
            "post_dispatch_evidence_failed", context.invocation_id, context.attempt_id,
            task_id, None, retryable=False, reconciliation_required=True,
            next_action="reconcile", value=value,
            business_reference=outcome.get("business_reference", ""),
            error=f"outcome {why}; {kept}",
        )  # fmt: skip

    def delivered(self, record: Record) -> Steps[str | Refused | None]:
        """One spooled outcome sent again, answered as `Spool.deliver` expects: None
        when recorded, `Refused` when the ledger never will, else why delivery stops."""
        try:
            status, body = yield from self.requested("POST", record.path, record.body)
        except LedgerUnreachable as exc:
            return str(exc)
        error = body.get("error", {}) if isinstance(body, Mapping) else {}
        if status in (200, 201) or error.get("type") == "outcome_conflict":
            return None  # recorded; a conflicting claim is kept by the ledger as evidence
        if status in (400, 413, 422):
            return Refused(status, f"{error.get('type')}: {error.get('message')}")
        return f"{status} {error.get('type')}: {error.get('message')}"


def abandoned_outcome(abandoned: BaseException) -> dict[str, Any]:
    """The outcome of a call its caller stopped waiting for: it may have had its
    effect, and only reconciliation can tell."""
    return {
        "kind": "post_dispatch_evidence_failed",
        "error": {
            "code": type(abandoned).__name__,
            "message": "the runtime stopped waiting for the tool;"
            " whether it had its effect is unknown",
        },
    }


def refusal(
    status: int, body: Any, invocation_id: str, attempt_id: str, task_id: str
) -> InvocationResult | None:
    """None when this request admitted the attempt: the tool may be called now.

    Only a 201 admits. A 200 replays an attempt admitted earlier, by an answer that
    got lost or by another process that may already have called the tool: calling
    it again could be a second effect, so that attempt is left to its outcome or,
    when none comes, to reconciliation.
    """
    if status == 201 and body.get("status") == "in_flight":
        return None
    error = body.get("error", {}) if isinstance(body, Mapping) else {}
    if status == 200 and body.get("status") == "in_flight":
        error = {
            "type": "attempt_in_flight",
            "message": f"attempt {attempt_id} was admitted before and awaits its outcome;"
            " the ledger reconciles it if none arrives",
        }
    if status in (200, 201) or error.get("type") in ("attempt_refused", "attempt_in_flight"):
        state = body if status in (200, 201) else error.get("details", {}).get("state", {})
        return InvocationResult(
            error.get("type", "attempt_refused"), invocation_id, attempt_id, task_id,
            state.get("status"), retryable=bool(state.get("retryable")),
            reconciliation_required=bool(state.get("reconciliation_required")),
            next_action=state.get("next_action", "none"),
            error=error.get("message", "the ledger admitted no new attempt"),
            flags=list(state.get("flags", [])),
        )  # fmt: skip
    raise LedgerRequestError(status, body)
