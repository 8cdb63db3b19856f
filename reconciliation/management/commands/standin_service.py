from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from reconciliation.standin import StandInService


class Command(BaseCommand):
    help = "Run the stand-in payments service (refunds with idempotency keys) on a port."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=9100)
        parser.add_argument("--db", type=Path, default=settings.DATA_DIR / "standin.sqlite3")

    def handle(self, *args: Any, port: int, db: Path, **options: Any) -> None:
        db.parent.mkdir(parents=True, exist_ok=True)
        service = StandInService(db, port)
        self.stdout.write(f"stand-in payments service on {service.url} (state in {db})")
        try:
            service.server.serve_forever()
        except KeyboardInterrupt:
            service.stop()
