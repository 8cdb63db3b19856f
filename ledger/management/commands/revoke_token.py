from __future__ import annotations

import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ledger.models import RuntimeToken


class Command(BaseCommand):
    help = "Revoke a runtime token, named by the whole token or by its prefix."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("token", help="the token, or its prefix (the part after 'ilr_')")
        parser.add_argument("--reason", default="", help="why, for the audit trail")

    def handle(self, *args: Any, token: str, reason: str, **options: Any) -> None:
        prefix = RuntimeToken.split(token) or token
        row = RuntimeToken.objects.select_related("runtime").filter(prefix=prefix).first()
        if row is None:
            raise CommandError(f"no token with prefix {prefix!r}")
        if not row.revoke(actor=f"cli:{getpass.getuser()}", reason=reason):
            self.stdout.write(f"Token {prefix} of {row.runtime} was already revoked.")
            return
        self.stdout.write(f"Revoked token {prefix} of runtime {row.runtime}.")
