from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ledger import acc
from ledger.capabilities import capability_register, capability_settings_change
from ledger.client import conformance
from reconciliation.standin import StandInService

SCOPE = "conformance.refund.create"


class Command(BaseCommand):
    help = (
        "Run the seven-step conformance kit against a running ledger that uses this "
        "database: it starts a stand-in payments service and registers "
        f"{SCOPE} (probed there, short deadlines). Exit status 1 on any FAIL."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000")
        parser.add_argument("--token", required=True, help="a runtime token of that ledger")
        parser.add_argument("--timeout", type=float, default=60.0)

    def handle(self, *args: Any, url: str, token: str, timeout: float, **options: Any) -> None:
        with tempfile.TemporaryDirectory() as folder:
            standin = StandInService(Path(folder) / "standin.sqlite3").start()
            try:
                declaration = acc.parse(
                    {"version": 1, "enabled": True, "scope": SCOPE,
                     "risk": {"level": "medium"}, "execution": {"timeout_ms": 1000}},
                    http_method="POST",
                )  # fmt: skip
                capability_register(declaration=declaration, source="conformance", actor="cli")
                capability_settings_change(
                    scope=SCOPE,
                    actor="cli",
                    reason="manage.py conformance: its stand-in, probed by idempotency key",
                    grace_ms=500,
                    probe=standin.probe_config(),
                )
                passed = conformance.run(
                    url=url, token=token, standin=standin.url, capability=SCOPE,
                    timeout=timeout, emit=self.stdout.write,
                )  # fmt: skip
            finally:
                standin.stop()
        if not passed:
            raise CommandError("conformance failed: see the FAIL lines above")
