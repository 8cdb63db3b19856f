"""Realistic traffic through a running ledger, then watch reconciliation settle it.

    make run                              # in one terminal
    uv run python manage.py demo          # in another

It starts the stand-in payments service, registers `demo.refund.create` (probed by
idempotency key at the stand-in, with short deadlines), creates a runtime, and over
the REST API plays runtimes that: succeed; are refused by the business; perform a
refund and then lose the outcome report; crash before dispatching. It then polls
until the ledger has settled every one, and shows that each key produced at most one
refund.
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
from ledger.models import Runtime, RuntimeToken
from reconciliation.standin import StandInService

SCOPE = "demo.refund.create"
SCENARIOS = ("succeeds", "business refuses", "outcome lost after refund", "crash before refund")
SETTLED = {"succeeded", "failed", "retry_allowed", "escalated"}


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
            ledger = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"})
            try:
                ledger.get("/healthz").raise_for_status()
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
            self.report(ledger, standin, runs)
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

    def play(self, ledger: httpx.Client, standin: StandInService, scenario: str) -> dict[str, Any]:
        run_id = uuid.uuid4().hex[:8]
        invocation_id, key = f"demo-{run_id}", f"refund-{run_id}"
        amount = 50_000 if scenario == "business refuses" else 40
        intent = ledger.post(
            "/api/v1/intents",
            json={
                "invocation_id": invocation_id,
                "task_id": "demo-task",
                "capability": SCOPE,
                "subject": "customer:42",
                "arguments": {"order": f"SO-{run_id}", "amount": amount},
                "idempotency_key": key,
                "attempt_id": "a1",
            },
        )
        intent.raise_for_status()
        outcome_url = f"/api/v1/invocations/{invocation_id}/attempts/a1/outcome"
        if scenario != "crash before refund":
            refund = httpx.post(
                f"{standin.url}/refunds",
                json={"idempotency_key": key, "order": f"SO-{run_id}", "amount": amount},
            )
            if scenario == "succeeds":
                ledger.post(
                    outcome_url,
                    json={"kind": "succeeded", "business_reference": refund.json()["id"]},
                )
            elif scenario == "business refuses":
                ledger.post(
                    outcome_url,
                    json={"kind": "business_failed", "error": {"code": refund.json()["error"]}},
                )
        self.stdout.write(f"  {invocation_id}: {scenario}")
        return {"invocation_id": invocation_id, "key": key, "scenario": scenario}

    def watch(self, ledger: httpx.Client, runs: list[dict[str, Any]], timeout: float) -> None:
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
    def state(ledger: httpx.Client, run: dict[str, Any]) -> dict[str, Any]:
        return ledger.get(f"/api/v1/invocations/{run['invocation_id']}").json()  # type: ignore[no-any-return]

    def report(
        self, ledger: httpx.Client, standin: StandInService, runs: list[dict[str, Any]]
    ) -> None:
        self.stdout.write(f"\n{'invocation':<16}{'scenario':<28}{'status':<16}{'cause':<28}refunds")
        for run in runs:
            state = self.state(ledger, run)
            refunds = 1 if standin.refunds.find(run["key"]) else 0
            self.stdout.write(
                f"{run['invocation_id']:<16}{run['scenario']:<28}{state['status']:<16}"
                f"{state['cause'] or '-':<28}{refunds}"
            )
        self.stdout.write(
            "\nEvery refund that happened is now `succeeded` with its reference; every one "
            "that did not may be retried under the same key (`retry_allowed`)."
        )
