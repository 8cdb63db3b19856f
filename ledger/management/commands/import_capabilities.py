from __future__ import annotations

import getpass
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ledger import acc
from ledger.capabilities import capabilities_import


class Command(BaseCommand):
    help = (
        "Register the x-agent-capability declarations of an OpenAPI 3 document (YAML or "
        "JSON). Valid ones are registered or updated (a change is a new version); each "
        "skipped operation is reported with its path, method and reason."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path)
        parser.add_argument("--dry-run", action="store_true", help="report, write nothing")

    def handle(self, *args: Any, file: Path, dry_run: bool, **options: Any) -> None:
        try:
            document = acc.load_document(file.read_bytes())
        except OSError as exc:
            raise CommandError(f"cannot read {file}: {exc.strerror}") from None
        except acc.NotAnOpenAPIDocument as exc:
            raise CommandError(f"{file}: {exc}; nothing was imported") from None
        report = capabilities_import(
            document=document,
            source=file.name,
            actor=f"cli:{getpass.getuser()}",
            dry_run=dry_run,
        )
        prefix = "would be " if dry_run else ""
        for found, outcome in report.registered:
            declaration = found.declaration
            self.stdout.write(
                f"{prefix}{outcome.value}: {declaration.scope} ({found.method} {found.path}, "
                f"risk {declaration.risk})"
            )
        for skipped in report.skipped:
            self.stdout.write(
                f"skipped: {skipped.method} {skipped.path}: {skipped.diagnostic}: {skipped.reason}"
            )
        self.stderr.write(
            f"{len(report.registered)} declaration(s) {prefix}registered, "
            f"{len(report.skipped)} skipped"
        )
