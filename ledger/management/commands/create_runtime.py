from __future__ import annotations

import getpass
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from ledger.models import AdminAction, Runtime, RuntimeToken


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

    @transaction.atomic
    def handle(self, *args: Any, name: str, add_token: bool, label: str, **options: Any) -> None:
        runtime = Runtime.objects.filter(name=name).first()
        if runtime is None:
            try:
                Runtime._meta.get_field("name").clean(name, None)
            except ValidationError as error:
                raise CommandError(f"runtime name {name!r}: {' '.join(error.messages)}") from None
            runtime = Runtime.objects.create(name=name)
            self.stderr.write(f"Created runtime {name!r}.")
        elif not add_token:
            raise CommandError(f"runtime {name!r} exists; pass --add-token for another token")
        row, token = RuntimeToken.issue(runtime=runtime, label=label)
        AdminAction.record(
            actor=f"cli:{getpass.getuser()}",
            action="token_issued",
            target=f"runtime {runtime.name}, token {row.prefix}",
            reason=label,
        )
        self.stderr.write(
            f"Token {row.PREFIX}_{row.prefix}_… issued; store it now, it is not shown again:"
        )
        self.stdout.write(token)
