from __future__ import annotations

import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.utils import timezone

from ledger.models import AdminAction, RuntimeToken


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
        if row.revoked_at is not None:
            self.stdout.write(f"Token {prefix} of {row.runtime} was already revoked.")
            return
        with transaction.atomic():
            RuntimeToken.objects.filter(pk=row.pk, revoked_at__isnull=True).update(
                revoked_at=timezone.now()
            )
            AdminAction.objects.create(
                actor=f"cli:{getpass.getuser()}",
                action="token_revoked",
                target=f"runtime {row.runtime.name}, token {prefix}",
                reason=reason,
            )
        self.stdout.write(f"Revoked token {prefix} of runtime {row.runtime}.")
