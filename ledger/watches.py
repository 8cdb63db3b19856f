"""What beat's watches share: they read the events the sealer has numbered since they
last read, and flag the invocations they find, one event each.

Following the seal sequence rather than event ids, each committed event is read once:
ids are taken when a write begins, so a lower one can commit after a higher one was
read. A watch's cursor moves in the transaction that records what it found, so a run
killed halfway records nothing, and the next run reads the same events again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction
from django.db.models import Max

from ledger.models import Invocation, Seal
from ledger.services import LedgerError, invocation_transitions

# Invocations flagged in one write.
FLAGS_PER_WRITE = 500

# What a watch found for one invocation, as it waits to be recorded: JSON, because the
# watch's row keeps those the ledger refused until it can record them.
type Entry = dict[str, Any]


def newest_sealed_sequence() -> int:
    return Seal.objects.aggregate(last=Max("last_sequence"))["last"] or 0


def exclusive(watch: str) -> None:
    """Wait for any other run of this watch to end (at its transaction's end): two
    runs reading one span would record what they find twice."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [watch])


@dataclass(frozen=True)
class Recorded:
    flagged: list[str]  # the invocations flagged, sorted
    # The entries the ledger refused to record: their invocations' rows were changed
    # outside it. The watch keeps them to try again next run.
    refused: list[Entry]


@dataclass(frozen=True)
class Flagging:
    """How a watch records what it found: as whom, by which kind of event, with what
    the event says (`change` flags the invocation and returns the event's data, or None
    when there is nothing left to record), and where a refusal is logged."""

    actor: str
    kind: str
    change: Callable[[Invocation, list[Entry]], dict[str, Any] | None]
    log: logging.Logger
    name: str

    def record(self, waiting: list[Entry], found: list[Entry]) -> Recorded:
        """Flag the invocations of these entries, one event each. A refusal is logged
        when it is new (for one of `found`)."""
        by_invocation: dict[str, list[Entry]] = {}
        for entry in waiting + found:
            by_invocation.setdefault(entry["invocation_id"], []).append(entry)
        flagged: list[str] = []
        refused: list[Entry] = []
        for unit in itertools.batched(by_invocation, FLAGS_PER_WRITE):
            for invocation_id, outcome in self._flag(list(unit), by_invocation):
                if not isinstance(outcome, LedgerError):
                    flagged.append(invocation_id)
                    continue
                entries = by_invocation[invocation_id]
                refused += entries
                if any(entry in found for entry in entries):
                    self.log.error(
                        "%s could not flag invocation=%s error=%s: %s",
                        self.name, invocation_id, outcome.type, outcome.message,
                    )  # fmt: skip
        return Recorded(flagged=sorted(flagged), refused=refused)

    def _flag(
        self, invocation_ids: list[str], by_invocation: Mapping[str, list[Entry]]
    ) -> list[tuple[str, LedgerError | None]]:
        """Flag the invocations in one write: those flagged (None) and those the
        ledger refused, with why. A refused unit is tried again one invocation at a
        time, so that one refused row does not hold up the rest."""
        try:
            with transaction.atomic():
                changed = invocation_transitions(
                    invocation_ids=invocation_ids,
                    actor=self.actor,
                    kind=self.kind,
                    change=lambda invocation: self.change(
                        invocation, by_invocation[invocation.invocation_id]
                    ),
                )
        except LedgerError as error:
            if len(invocation_ids) == 1:
                return [(invocation_ids[0], error)]
            return [each for one in invocation_ids for each in self._flag([one], by_invocation)]
        return [(invocation.invocation_id, None) for invocation in changed]
