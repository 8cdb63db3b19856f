from __future__ import annotations

import datetime as dt
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ledger import anchors
from ledger.integrity import CAPABILITY_ADVICE, UNEXPLAINED_HISTORY_ADVICE, verify


def moment(value: str) -> dt.datetime:
    parsed = dt.datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


class Command(BaseCommand):
    help = (
        "Recompute every invocation's hash chain and every seal (events and seals created "
        "in [--since, --until)) and the action log's chain, check every capability and "
        "declaration against the action log, replay each chain's recorded states through "
        "the retry policy, and with --projections compare each invocation "
        "row with the state its last event recorded; with --anchored, check that the ledger "
        "still holds hashes kept outside it. Names every broken link; exit status 1 if any."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--since", type=moment, help="ISO 8601 time (UTC if no zone)")
        parser.add_argument("--until", type=moment, help="ISO 8601 time (UTC if no zone)")
        parser.add_argument("--projections", action="store_true")
        parser.add_argument(
            "--anchored",
            action="append",
            default=[],
            metavar="HASH",
            help="a seal's or an action's hash kept outside the database (the anchor store, "
            "the sealer's log); repeatable",
        )

    def handle(
        self,
        *args: Any,
        since: Any,
        until: Any,
        projections: bool,
        anchored: list[str],
        **options: Any,
    ) -> None:
        report = verify(since=since, until=until, projections=projections)
        missing = anchors.not_held(anchored)
        try:
            tokens = anchors.check_tokens()
        except anchors.TokenBroken as exc:  # the roots file unreadable
            raise CommandError(f"timestamp tokens not checked: {exc}") from None
        for broken in report.breaks:
            self.stdout.write(f"BROKEN {broken}")
        for hash_ in missing:
            self.stdout.write(
                f"BROKEN anchored hash {hash_} is no seal's or action's in the ledger: the "
                "chains were rewritten after it was kept, or it was mistyped"
            )
        for anchor_id, why in tokens.broken:
            self.stdout.write(
                f"BROKEN anchor {anchor_id}'s timestamp token does not verify ({why}): its "
                "seal or action row was rewritten after it was timestamped, or the token was"
            )
        if report.projections_broken:
            self.stdout.write(
                "A row that disagrees with intact events is put back from them by "
                "`manage.py restore_projection INVOCATION_ID --by ADMIN --reason TEXT`."
            )
        if report.histories_unexplained:
            self.stdout.write(UNEXPLAINED_HISTORY_ADVICE)
        if report.capabilities_unrecorded:
            self.stdout.write(CAPABILITY_ADVICE)
        breaks = len(report.breaks) + len(missing) + len(tokens.broken)
        if breaks:
            raise CommandError(f"{breaks} broken link(s) in {report.summary}")
        self.stdout.write(f"OK: {report.summary} verified")
        if anchored:
            self.stdout.write(f"anchored: the ledger holds each of the {len(anchored)} hash(es)")
        if tokens.newest is not None:
            timestamped, signed_at = tokens.newest
            self.stdout.write(
                f"timestamped: the {tokens.checked} anchor token(s) verify against "
                f"LEDGER_ANCHOR_TSA_ROOTS; the newest, of seal {timestamped.seal_hash or '-'}, "
                f"was signed at {signed_at.isoformat()} by {timestamped.url}"
            )
        if tokens.unchecked:
            self.stdout.write(
                f"{tokens.unchecked} anchor timestamp token(s) not checked: set "
                "LEDGER_ANCHOR_TSA_ROOTS to the authority's root certificates"
            )
        if report.newest_seal is not None:
            seal = report.newest_seal
            self.stdout.write(
                f"newest seal: {seal.hash} (sequence {seal.first_sequence}-{seal.last_sequence}); "
                "compare it with the sealer's log"
            )
        if (anchor := anchors.newest()) is not None:
            self.stdout.write(
                f"newest anchor: seal {anchor.seal_hash or '-'}, "
                f"action {anchor.action_hash or '-'}, sent to {anchor.url} "
                f"at {anchor.sent_at.isoformat()} (receipt {anchor.receipt[:80]!r}); "
                + (
                    "its timestamp token is checked above"
                    if anchor.token is not None
                    else "check them with --anchored against the store's copy"
                )
            )
