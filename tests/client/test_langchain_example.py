"""The LangChain example, driven as the framework would call it; no model involved."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from ledger.client import AsyncLedgerClient, BusinessFailure, LedgerClient
from ledger.client.examples.langchain_tool import async_refund_tool, refund_tool
from ledger.models import Invocation
from reconciliation.standin import StandInService


def payments(standin: StandInService) -> Any:
    def refund(order: str, amount: float, key: str) -> dict[str, Any]:
        made = httpx.post(
            f"{standin.url}/refunds",
            json={"idempotency_key": key, "order": order, "amount": amount},
        )
        if made.status_code == 422:
            raise BusinessFailure(made.json()["error"])
        return made.json()  # type: ignore[no-any-return]

    return refund


def test_the_tool_refunds_once_and_tells_the_model_not_to_repeat(
    live_server: Any, token: str, standin: StandInService
) -> None:
    tool = refund_tool(LedgerClient(live_server.url, token), payments(standin), task_id="chat-1")
    first = tool.invoke({"order": "SO-1", "amount": 12.5})
    assert first.startswith("Refunded SO-1: RF-")
    again = tool.invoke({"order": "SO-1", "amount": 12.5})
    assert again == "A refund for SO-1 was already requested (succeeded); do not request it again."
    refused = tool.invoke({"order": "SO-2", "amount": 50_000})
    assert refused == "The payments system refused the refund for SO-2: refund_limit_exceeded."
    assert standin.refunds.count() == 1
    assert dict(Invocation.objects.values_list("idempotency_key", "status")) == {
        "refund-SO-1": "succeeded",
        "refund-SO-2": "failed",
    }


def test_an_unknown_outcome_tells_the_model_not_to_retry(
    live_server: Any, token: str, standin: StandInService
) -> None:
    def times_out(order: str, amount: float, key: str) -> dict[str, Any]:
        payments(standin)(order, amount, key)
        raise TimeoutError("payments did not answer")

    tool = refund_tool(LedgerClient(live_server.url, token), times_out, task_id="chat-2")
    answer = tool.invoke({"order": "SO-3", "amount": 1})
    assert "Do not retry it" in answer
    assert Invocation.objects.get().status == "reconciliation_required"


def test_a_request_after_a_retryable_refusal_retries_under_the_same_key(
    live_server: Any, token: str, standin: StandInService
) -> None:
    """The model asks again for an order the payments system was too busy for: the
    ledger's earlier invocation is retried (attempt a2, same key), not a new one."""
    calls: list[str] = []

    def busy_once(order: str, amount: float, key: str) -> dict[str, Any]:
        calls.append(key)
        if len(calls) == 1:
            raise BusinessFailure("busy", "try again", retryable=True)
        return payments(standin)(order, amount, key)

    tool = refund_tool(LedgerClient(live_server.url, token), busy_once, task_id="chat-3")
    first = tool.invoke({"order": "SO-4", "amount": 5})
    assert first == "The payments system refused the refund for SO-4: try again."
    second = tool.invoke({"order": "SO-4", "amount": 5})
    assert second.startswith("Refunded SO-4: RF-")
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.attempt_count) == ("succeeded", 2)
    assert standin.refunds.count() == 1
    assert calls == ["refund-SO-4", "refund-SO-4"]


def async_payments(standin: StandInService) -> Any:
    async def refund(order: str, amount: float, key: str) -> dict[str, Any]:
        async with httpx.AsyncClient() as http:
            made = await http.post(
                f"{standin.url}/refunds",
                json={"idempotency_key": key, "order": order, "amount": amount},
            )
        if made.status_code == 422:
            raise BusinessFailure(made.json()["error"])
        return made.json()  # type: ignore[no-any-return]

    return refund


def test_the_async_tool_answers_as_the_blocking_one(
    live_server: Any, token: str, standin: StandInService
) -> None:
    """The same conversation through `ainvoke`, on an event loop: one refund, a repeat
    answered from the ledger, a refusal, and a retryable refusal retried under its key."""
    busy = {"once": True}
    pay = async_payments(standin)

    async def busy_once(order: str, amount: float, key: str) -> dict[str, Any]:
        if order == "SO-4" and busy.pop("once", False):
            raise BusinessFailure("busy", "try again", retryable=True)
        return await pay(order, amount, key)  # type: ignore[no-any-return]

    async def conversation() -> list[str]:
        async with AsyncLedgerClient(live_server.url, token) as ledger:
            tool = async_refund_tool(ledger, busy_once, task_id="chat-async")
            asked = [
                {"order": "SO-1", "amount": 12.5},
                {"order": "SO-1", "amount": 12.5},
                {"order": "SO-2", "amount": 50_000},
                {"order": "SO-4", "amount": 5},
                {"order": "SO-4", "amount": 5},
            ]
            return [await tool.ainvoke(question) for question in asked]

    answers = asyncio.run(conversation())
    assert answers[0].startswith("Refunded SO-1: RF-")
    assert answers[1:4] == [
        "A refund for SO-1 was already requested (succeeded); do not request it again.",
        "The payments system refused the refund for SO-2: refund_limit_exceeded.",
        "The payments system refused the refund for SO-4: try again.",
    ]
    assert answers[4].startswith("Refunded SO-4: RF-")
    assert standin.refunds.count() == 2
    assert dict(Invocation.objects.values_list("idempotency_key", "status")) == {
        "refund-SO-1": "succeeded",
        "refund-SO-2": "failed",
        "refund-SO-4": "succeeded",
    }
    assert Invocation.objects.get(idempotency_key="refund-SO-4").attempt_count == 2
