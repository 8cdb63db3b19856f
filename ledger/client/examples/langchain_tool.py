"""A LangChain tool whose business effect goes through the ledger.

The agent framework sees an ordinary tool. Behind it, the intent is recorded before
the refund is sent, the outcome after; if the outcome is unknown the model is told
plainly not to retry, and a repeated request for the same order is answered from
the ledger instead of refunding twice. `refund_tool` is the blocking tool,
`async_refund_tool` the same for an agent that runs on an event loop (`ainvoke`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from langchain_core.tools import BaseTool, tool

from ledger.client import (
    AsyncLedgerClient,
    BusinessFailure,
    CallContext,
    InvocationResult,
    LedgerClient,
    LedgerRequestError,
)

# The business call: (order, amount, idempotency_key) -> {"id": ...}; raises
# BusinessFailure when the payments system refuses.
Refund = Callable[[str, float, str], dict[str, Any]]
AsyncRefund = Callable[[str, float, str], Awaitable[dict[str, Any]]]


def refund_tool(ledger: LedgerClient, refund: Refund, *, task_id: str) -> BaseTool:
    @tool
    def create_refund(order: str, amount: float) -> str:
        """Refund an order. Returns the refund id, or why there is none."""

        def call(ctx: CallContext) -> dict[str, Any]:
            return refund(order, amount, ctx.idempotency_key)

        try:
            result = ledger.invoke(
                task_id=task_id,
                capability="refund.create",
                arguments={"order": order, "amount": amount},
                idempotency_key=f"refund-{order}",
                call=call,
                reference=lambda value: value["id"],
            )
        except LedgerRequestError as error:
            # This order's key is bound to an earlier invocation of this runtime: its
            # state, not a second refund, answers the model.
            earlier = earlier_invocation(error)
            status = ledger.state(earlier)["status"]
            if status != "retry_allowed":
                return already_requested(order, status)
            result = ledger.retry(earlier, call, reference=lambda value: value["id"])
        return answer(order, result)

    return create_refund


def async_refund_tool(ledger: AsyncLedgerClient, refund: AsyncRefund, *, task_id: str) -> BaseTool:
    @tool
    async def create_refund(order: str, amount: float) -> str:
        """Refund an order. Returns the refund id, or why there is none."""

        async def call(ctx: CallContext) -> dict[str, Any]:
            return await refund(order, amount, ctx.idempotency_key)

        try:
            result = await ledger.invoke(
                task_id=task_id,
                capability="refund.create",
                arguments={"order": order, "amount": amount},
                idempotency_key=f"refund-{order}",
                call=call,
                reference=lambda value: value["id"],
            )
        except LedgerRequestError as error:
            earlier = earlier_invocation(error)
            status = (await ledger.state(earlier))["status"]
            if status != "retry_allowed":
                return already_requested(order, status)
            result = await ledger.retry(earlier, call, reference=lambda value: value["id"])
        return answer(order, result)

    return create_refund


def earlier_invocation(error: LedgerRequestError) -> str:
    """The invocation of this runtime that the refused intent's key is bound to; any
    other refusal is raised again."""
    earlier = error.details.get("invocation_id")
    if error.type != "idempotency_key_in_use" or not earlier:
        raise error
    return str(earlier)


def already_requested(order: str, status: str) -> str:
    return f"A refund for {order} was already requested ({status}); do not request it again."


def answer(order: str, result: InvocationResult) -> str:
    """What the model is told, from the ledger's typed result."""
    if result.kind == "succeeded":
        return f"Refunded {order}: {result.business_reference}."
    if result.reconciliation_required or result.kind == "attempt_in_flight":
        return (
            f"The refund for {order} may or may not have happened; the ledger is "
            "finding out. Do not retry it; tell the user it is being checked."
        )
    if result.kind == "business_failed":
        return f"The payments system refused the refund for {order}: {result.error}."
    return f"The refund for {order} was not sent ({result.kind}); it is safe to try again."


__all__ = ["BusinessFailure", "async_refund_tool", "refund_tool"]
