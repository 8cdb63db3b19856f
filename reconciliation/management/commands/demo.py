"""Realistic traffic through a running ledger, then watch reconciliation settle it.

    make run                              # in one terminal
    uv run python manage.py demo          # in another

It starts the stand-in payments service, registers `demo.refund.create` (probed by
idempotency key at the stand-in, with short deadlines), creates a runtime, and over
the REST API plays runtimes that: succeed; are refused by the business; perform a
refund and then lose the outcome report; crash before dispatching. It then polls
until the ledger has settled every one, retries under the same key each one the ledger
found never happened (as a runtime does on `retry_allowed`), and shows that each key
produced at most one refund. It sends through the runtime client's transport
(`LedgerClient.request`), which resends what the ledger did not take (a web process
or the database restarting under it).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ledger import acc
from ledger.capabilities import capability_register, capability_settings_change
from ledger.client import LedgerClient
from ledger.models import Runtime, RuntimeToken
from reconciliation.standin import StandInService

SCOPE = "demo.refund.create"
SCENARIOS = ("succeeds", "business refuses", "outcome lost after refund", "crash before refund")
SETTLED = {"succeeded", "failed", "retry_allowed", "escalated"}
# How often a request the ledger did not take is sent again, waiting 0.2 s, then twice
# as long each time: about 50 s in all, more than `make run` takes to restart anything.
RESENDS = 8


def send(ledger: LedgerClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a runtime's request; its typed state, or the ledger's typed error raised."""
    status, answer = ledger.request("POST", path, body)
    if status not in (200, 201):
        raise CommandError(f"POST {path}: {status} {answer}")
    return answer  # type: ignore[no-any-return]


class Command(BaseCommand):
    help = "Run demo traffic through a running ledger (`make run`) and watch reconciliation."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000", help="the ledger")
        parser.add_argument("--rounds", type=int, default=3, help="each scenario this often")
        parser.add_argument("--timeout", type=float, default=90.0, help="seconds to wait")

    def handle(self, *args: Any, url: str, rounds: int, timeout: float, **options: Any) -> None:
        state = Path(settings.DATA_DIR)
        state.mkdir(parents=True, exist_ok=True)
        standin = StandInService(state / "demo-standin.sqlite3").start()
        try:
            token = self.prepare(standin)
            ledger = LedgerClient(url, token, retries=RESENDS)
            try:
                ledger.http.get("/healthz").raise_for_status()
            except httpx.HTTPError as exc:
                raise CommandError(
                    f"no ledger at {url} ({exc}); start it with `make run`"
                ) from None
            runs = [
                self.play(ledger, standin, scenario)
                for _ in range(rounds)
                for scenario in SCENARIOS
            ]
            self.watch(ledger, runs, timeout)
            for run in runs:
                run["settled"] = self.state(ledger, run)
            self.retry_allowed(ledger, standin, runs)
            self.report(standin, runs)
        finally:
            standin.stop()

    def prepare(self, standin: StandInService) -> str:
        declaration = acc.parse(
            {
                "version": 1,
                "enabled": True,
                "scope": SCOPE,
                "risk": {"level": "medium"},
                "execution": {"readonly": False, "idempotent": True, "timeout_ms": 1000},
            },
            http_method="POST",
        )
        capability_register(declaration=declaration, source="demo", actor="cli:demo")
        capability_settings_change(
            scope=SCOPE,
            actor="cli:demo",
            reason="manage.py demo: its stand-in payments service, probed by idempotency key",
            grace_ms=1000,
            probe=standin.probe_config(),
        )
        runtime, _ = Runtime.objects.get_or_create(name="demo-runtime")
        _, token = RuntimeToken.issue(runtime=runtime, label="manage.py demo")
        self.stdout.write(f"stand-in payments service on {standin.url}; capability {SCOPE}")
        return token

    def play(self, ledger: LedgerClient, standin: StandInService, scenario: str) -> dict[str, Any]:
        run_id = uuid.uuid4().hex[:8]
        invocation_id, key = f"demo-{run_id}", f"refund-{run_id}"
        amount = 50_000 if scenario == "business refuses" else 40
        send(
            ledger,
            "/api/v1/intents",
            {
                "invocation_id": invocation_id,
                "task_id": "demo-task",
                "capability": SCOPE,
                "subject": "customer:42",
                "arguments": {"order": f"SO-{run_id}", "amount": amount},
                "idempotency_key": key,
                "attempt_id": "a1",
            },
        )
        outcome_url = f"/api/v1/invocations/{invocation_id}/attempts/a1/outcome"
        run = {"invocation_id": invocation_id, "key": key, "scenario": scenario, "amount": amount}
        if scenario != "crash before refund":
            refund = self.refund(standin, run)
            if scenario == "succeeds":
                send(
                    ledger,
                    outcome_url,
                    {"kind": "succeeded", "business_reference": refund.json()["id"]},
                )
            elif scenario == "business refuses":
                send(
                    ledger,
                    outcome_url,
                    {"kind": "business_failed", "error": {"code": refund.json()["error"]}},
                )
        self.stdout.write(f"  {invocation_id}: {scenario}")
        return run

    @staticmethod
    def refund(standin: StandInService, run: dict[str, Any]) -> httpx.Response:
        """The business call: a refund at the stand-in, under the run's key."""
        order = run["invocation_id"].replace("demo-", "SO-")
        return httpx.post(
            f"{standin.url}/refunds",
            json={"idempotency_key": run["key"], "order": order, "amount": run["amount"]},
        )

    def watch(self, ledger: LedgerClient, runs: list[dict[str, Any]], timeout: float) -> None:
        self.stdout.write("waiting for the sweep and the probes (worker and beat must run)…")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = [self.state(ledger, run)["status"] for run in runs]
            if all(status in SETTLED for status in statuses):
                return
            time.sleep(1)
        raise CommandError(
            "not everything settled in time: is the Celery worker and beat running (make run)?"
        )

    @staticmethod
    def state(ledger: LedgerClient, run: dict[str, Any]) -> dict[str, Any]:
        return ledger.state(run["invocation_id"])

    def retry_allowed(
        self, ledger: LedgerClient, standin: StandInService, runs: list[dict[str, Any]]
    ) -> None:
        """What a runtime does with `retry_allowed`: a new attempt of the same invocation,
        the business call again under the same key, and its outcome."""
        for run in runs:
            if run["settled"]["status"] != "retry_allowed":
                continue
            invocation = f"/api/v1/invocations/{run['invocation_id']}"
            send(ledger, f"{invocation}/attempts", {"attempt_id": "a2"})
            refund = self.refund(standin, run)
            send(
                ledger,
                f"{invocation}/attempts/a2/outcome",
                {"kind": "succeeded", "business_reference": refund.json()["id"]},
            )
            run["retried"] = self.state(ledger, run)["status"]

    def report(self, standin: StandInService, runs: list[dict[str, Any]]) -> None:
        self.stdout.write(
            f"\n{'invocation':<16}{'scenario':<28}{'settled as':<16}{'cause':<28}"
            f"{'retried':<12}refunds"
        )
        for run in runs:
            settled = run["settled"]
            refunds = 1 if standin.refunds.find(run["key"]) else 0
            self.stdout.write(
                f"{run['invocation_id']:<16}{run['scenario']:<28}{settled['status']:<16}"
                f"{settled['cause'] or '-':<28}{run.get('retried', '-'):<12}{refunds}"
            )
        self.stdout.write(
            "\nEvery refund that happened is `succeeded` with its reference, found by the "
            "probe when its outcome was lost; every one that never happened was retried "
            "under the same key once the ledger allowed it: one refund at most per key."
        )
