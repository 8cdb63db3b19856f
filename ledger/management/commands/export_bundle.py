from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ledger.bundles import export_bundle
from ledger.management.commands.verify_ledger import moment


class Command(BaseCommand):
    help = (
        "Write an evidence bundle (events with their chains, covering seals, manifest) "
        "that `python -m ledger.verify_bundle DIR` verifies offline."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("folder", type=Path)
        parser.add_argument("--invocation", help="one invocation's whole chain")
        parser.add_argument("--since", type=moment)
        parser.add_argument("--until", type=moment)

    def handle(self, *args: Any, folder: Path, invocation: str | None, **options: Any) -> None:
        written = export_bundle(
            folder, invocation_id=invocation, since=options["since"], until=options["until"]
        )
        self.stdout.write(
            f"bundle in {folder}: {written['events']} events, {written['seals']} seals; "
            f"verify with: python -m ledger.verify_bundle {folder} --seal HASH "
            "(HASH: a seal hash from the sealer's log, or the anchor store's copy of the one "
            "anchors.jsonl names)"
        )
