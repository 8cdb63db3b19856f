from __future__ import annotations

import getpass
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from ledger.models import Runtime, RuntimeToken


class Command(BaseCommand):
    help = (
        "Register a runtime and issue its first API token. The token is printed once, "
        "alone on the last line; only its hash is stored."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the runtime's unique name")
        parser.add_argument(
            "--add-token",
            action="store_true",
            help="the runtime exists already: issue it another token",
        )
        parser.add_argument("--label", default="", help="a note on what the token is for")

    def handle(self, *args: Any, name: str, add_token: bool, label: str, **options: Any) -> None:
        created, row, token = self.issue(name=name, add_token=add_token, label=label)
        # Written once the token is committed, and after the log line its action
        # writes then: the token stays alone on the last line.
        if created:
            self.stderr.write(f"Created runtime {name!r}.")
        self.stderr.write(
            f"Token {row.PREFIX}_{row.prefix}_… issued; store it now, it is not shown again:"
        )
        self.stdout.write(token)

    @transaction.atomic
    def issue(self, *, name: str, add_token: bool, label: str) -> tuple[bool, RuntimeToken, str]:
        """The runtime (created if new, and whether it was), its new token and that
        token's action in the log."""
        runtime = Runtime.objects.filter(name=name).first()
        created = runtime is None
        if runtime is None:
            try:
                Runtime._meta.get_field("name").clean(name, None)
            except ValidationError as error:
                raise CommandError(f"runtime name {name!r}: {' '.join(error.messages)}") from None
            runtime = Runtime.objects.create(name=name)
        elif not add_token:
            raise CommandError(f"runtime {name!r} exists; pass --add-token for another token")
        row, token = RuntimeToken.issue_logged(
            runtime=runtime, actor=f"cli:{getpass.getuser()}", label=label
        )
        return created, row, token
