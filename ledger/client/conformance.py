"""The conformance kit: does this ledger keep one intent to at most one effect?

    python -m ledger.client.conformance --url URL --token TOKEN \\
        --standin http://payments-standin:9100 --capability conformance.refund.create

It plays a runtime against a live ledger and a stand-in payments service that the
ledger's probe for CAPABILITY reads (`manage.py conformance` sets all of that up on
a local ledger), in seven steps, each printed PASS or FAIL with its evidence:

1. persist the intent;  2. let the tool create an observable effect;
3. force the outcome append to fail;  4. verify a distinct non-retryable failure;
5. verify no second dispatch happens automatically;  6. reconcile by stable identity;
7. verify the evidence is completed without another effect.

Exit status 0 only if every step passed. httpx only; no Django.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ledger.client.runtime import CallContext, LedgerClient

SETTLED = ("succeeded", "escalated", "retry_allowed", "failed")


@dataclass
class Step:
    name: str
    passed: bool
    evidence: str


class Failed(Exception):
    pass


def _wait(condition: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise Failed(f"{what} did not happen within {seconds:.0f}s")


def run(
    *, url: str, token: str, standin: str, capability: str, timeout: float = 60.0,
    emit: Callable[[str], object] = print,
) -> bool:  # fmt: skip
    run_id = uuid.uuid4().hex[:10]
    invocation_id, key = f"conformance-{run_id}", f"conformance-{run_id}"
    descriptor, spool = tempfile.mkstemp(suffix=".spool")
    os.close(descriptor)
    # Delivering the spool only when asked (step 7), after the reconciliation it tests.
    ledger = LedgerClient(url, token, spool=spool, auto_flush=False)
    # Same ledger, same spool; its outcome reports go nowhere.
    severed = LedgerClient("http://127.0.0.1:9", token, spool=spool, retries=0)
    payments = httpx.Client(base_url=standin, timeout=10)
    effects: list[dict[str, Any]] = []
    steps: list[Step] = []
    context = CallContext(invocation_id, "a1", key)

    def refunds_for_key() -> int:
        found = payments.get("/refunds", params={"idempotency_key": key})
        return 1 if found.status_code == 200 else 0

    def refund(ctx: CallContext) -> dict[str, Any]:
        made = payments.post("/refunds", json={"idempotency_key": ctx.idempotency_key,
                                               "order": run_id, "amount": 1})  # fmt: skip
        made.raise_for_status()
        effects.append(made.json())
        return made.json()

    def state() -> dict[str, Any]:
        return ledger.http.get(f"/api/v1/invocations/{invocation_id}").json()  # type: ignore[no-any-return]

    def step(name: str, check: Callable[[], str]) -> bool:
        try:
            evidence, passed = check(), True
        except Failed as failed:
            evidence, passed = str(failed), False
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            evidence, passed = f"{type(exc).__name__}: {exc}", False
        steps.append(Step(name, passed, evidence))
        emit(f"{'PASS' if passed else 'FAIL'}  {len(steps)}. {name}: {evidence}")
        return passed

    def persist_intent() -> str:
        status, body = ledger.request("POST", "/api/v1/intents", {
            "invocation_id": invocation_id, "task_id": f"conformance-{run_id}",
            "capability": capability, "arguments": {"order": run_id, "amount": 1},
            "idempotency_key": key, "attempt_id": "a1", "subject": "conformance",
        })  # fmt: skip
        if status != 201 or body["status"] != "in_flight":
            raise Failed(f"intent answered {status}: {body}")
        return f"{invocation_id} recorded, attempt a1 admitted ({body['status']})"

    def create_effect() -> str:
        made = refund(context)
        if refunds_for_key() != 1:
            raise Failed("the stand-in does not show the refund")
        return f"refund {made['id']} exists for key {key}"

    def fail_outcome_append() -> str:
        result = severed._dispatch(context, "conformance", lambda ctx: effects[-1],
                                   lambda v: v["id"])  # fmt: skip
        if result.kind != "post_dispatch_evidence_failed" or result.retryable:
            raise Failed(f"the runtime saw {result.kind} (retryable={result.retryable})")
        return f"runtime saw {result.kind}, retryable=false; outcome kept in the spool"

    def distinct_failure() -> str:
        seen = _wait(lambda: (s := state())["status"] != "in_flight" and s, timeout,
                     "the ledger flagging the missing outcome (is its sweep running?)")  # fmt: skip
        if seen["failure_class"] != "post_dispatch_evidence_failed" or seen["retryable"]:
            raise Failed(f"the ledger says {seen}")
        return (f"ledger: failure_class={seen['failure_class']}, retryable=false, "
                f"reconciliation_required={seen['reconciliation_required']}")  # fmt: skip

    def no_second_dispatch() -> str:
        calls: list[CallContext] = []

        def tool(ctx: CallContext) -> dict[str, Any]:
            calls.append(ctx)
            return refund(ctx)

        result = ledger.retry(invocation_id, tool)
        if result.kind != "attempt_refused" or calls:
            raise Failed(f"a new attempt was admitted ({result.kind}); the tool ran {len(calls)}x")
        if refunds_for_key() != 1:
            raise Failed("a second refund exists")
        return f"retry refused ({result.kind}, next_action={result.next_action}); one refund"

    def reconcile() -> str:
        settled = _wait(
            lambda: (s := state())["status"] in SETTLED and s,
            timeout,
            "reconciliation settling the invocation (is the worker running?)",
        )
        if settled["status"] != "succeeded":
            raise Failed(f"settled as {settled['status']} ({settled['cause']}), not succeeded")
        probes = [e for e in settled["events"] if e["kind"] == "probe_run"]
        found = probes[-1]["data"]["business_reference"] if probes else None
        if found != effects[0]["id"]:
            raise Failed(f"the probe found {found!r}, the refund is {effects[0]['id']!r}")
        return f"probe by idempotency key found {found}; status succeeded"

    def evidence_completed() -> str:
        report = ledger.flush()
        final = state()
        if report.delivered != 1 or report.damaged:
            raise Failed(f"the spooled outcome was not delivered: {report}")
        if final["status"] != "succeeded" or "evidence_conflict" in final["flags"]:
            raise Failed(f"after the late outcome the ledger says {final['status']}")
        if refunds_for_key() != 1 or len(effects) != 1:
            raise Failed("another effect happened")
        late = [e for e in final["events"] if e["kind"] == "late_outcome_recorded"]
        return f"late outcome recorded ({len(late)} event), still succeeded, one refund"

    checks = [
        ("persist intent", persist_intent),
        ("tool creates an observable effect", create_effect),
        ("outcome append fails", fail_outcome_append),
        ("distinct non-retryable failure", distinct_failure),
        ("no automatic second dispatch", no_second_dispatch),
        ("reconcile by stable identity", reconcile),
        ("evidence completed without another effect", evidence_completed),
    ]
    for name, check in checks:
        if not step(name, check):
            for rest, _ in checks[len(steps) :]:
                steps.append(Step(rest, False, "not run"))
                emit(f"FAIL  {len(steps)}. {rest}: not run")
            break
    passed = all(s.passed for s in steps)
    emit(f"{sum(s.passed for s in steps)} passed, {sum(not s.passed for s in steps)} failed")
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ledger.client.conformance")
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--standin", required=True, help="the stand-in payments service")
    parser.add_argument("--capability", default="conformance.refund.create")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    ok = run(url=args.url, token=args.token, standin=args.standin,
             capability=args.capability, timeout=args.timeout)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
