from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ledger.integrity import restore_projection
from ledger.permissions import roles
from ledger.services import LedgerError


class Command(BaseCommand):
    help = (
        "Put invocation rows back to the state their events recorded (what verify_ledger "
        "--projections reports as broken), each with a projection_restored event naming "
        "the person, the reason, and every field found and restored. A row whose chain of "
        "events is itself broken is refused. Exit status 1 if any was refused."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("invocation_ids", nargs="+", metavar="INVOCATION_ID")
        parser.add_argument(
            "--by", required=True, help="the console user (admin role) who restores them"
        )
        parser.add_argument("--reason", required=True, help="why, for the audit trail")

    def handle(
        self, *args: Any, invocation_ids: list[str], by: str, reason: str, **options: Any
    ) -> None:
        person = get_user_model().objects.filter(username=by, is_active=True).first()
        if person is None or "admin" not in roles(person):
            raise CommandError(f"{by!r} is not an active console user with the admin role")
        if not reason.strip():
            raise CommandError("--reason must say why")
        refused = 0
        for invocation_id in invocation_ids:
            try:
                restored = restore_projection(
                    invocation_id=invocation_id, actor=f"user:{by}", reason=reason
                )
            except LedgerError as error:
                refused += 1
                self.stderr.write(f"{invocation_id}: not restored: {error.message}")
                continue
            if not restored:
                self.stdout.write(f"{invocation_id}: agrees with its events; nothing written")
                continue
            changes = ", ".join(
                f"{name} {change['found']!r} -> {change['recorded']!r}"
                for name, change in restored.items()
            )
            self.stdout.write(f"{invocation_id}: restored {changes}")
        if refused:
            raise CommandError(f"{refused} of {len(invocation_ids)} not restored")
