from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ledger.audit import AuditFilterForm, csv_lines, export_rows, jsonl_lines


class Command(BaseCommand):
    help = (
        "Stream the audit export (one row per event, with its hashes) to standard output, "
        "in constant memory. Filters as on the audit page: --since, --until, --runtime, …"
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--format", choices=["csv", "jsonl"], default="csv")
        for name in AuditFilterForm.base_fields:
            if name not in ("after", "order"):
                parser.add_argument(f"--{name.replace('_', '-')}", dest=name)

    def handle(self, *args: Any, format: str, **options: Any) -> None:
        given = {k: v for k, v in options.items() if k in AuditFilterForm.base_fields and v}
        form = AuditFilterForm(given)
        if not form.is_valid():
            raise CommandError(f"invalid filters: {form.errors.as_text()}")
        rows = export_rows(form.cleaned_data)
        lines = csv_lines(rows) if format == "csv" else jsonl_lines(rows)
        for line in lines:
            self.stdout.write(line, ending="")
