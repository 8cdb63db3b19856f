"""The reference watch: the earlier invocations naming a business reference that a
later invocation's evidence names too.

Evidence naming a business reference that other invocations' evidence names already
flags its own invocation `reference_shared` as it is recorded, and its event names the
others (services.shared_reference_data). The earlier ones are not changed then: the
write touches only the invocations it was sent, often another runtime's. This watch
tells them after. Beat's task reads the events the sealer has numbered since it last
read (`ledger.watches`), and each that names a shared reference flags every other
invocation whose evidence names that reference and is not flagged yet, with a
`reference_shared` event saying which reference and which later invocation (as the
flagged invocation's runtime may read it: another runtime's only as a count).

Once flagged, an invocation is not told of the later ones after: the flag is what
compliance searches by, and the console's invocation page and the audit search by
reference show every invocation naming it. A ledger's first run reads from its first
seal, so references shared before the watch existed are found too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import QuerySet

from ledger import policy, watches
from ledger.models import (
    HAS_BUSINESS_REFERENCE,
    NAMES_A_SHARED_REFERENCE,
    Event,
    Invocation,
    ReferenceWatch,
)
from ledger.services import shared_reference_data
from ledger.watches import Entry

log = logging.getLogger(__name__)

WATCH = "ledger:reference_watch"
# Sealed events one run reads through: a run with more to read leaves them to the
# next, in the same beat task (ledger.tasks), each in its own transaction.
BATCH = 100_000


@dataclass(frozen=True)
class Watched:
    # Sealed events read that name a shared reference.
    shared: int
    # False when the run stopped a batch short of the newest seal: more events wait.
    caught_up: bool
    flagged: list[str]
    unrecorded: int


def watch_shared_references(*, batch: int | None = None) -> Watched:
    """Read the events sealed since the last run, within `batch` (BATCH) of it, and
    flag the earlier invocations naming the shared references they name."""
    batch = batch or BATCH
    with transaction.atomic():
        watches.exclusive("ledger.watch_shared_references")
        sealed = watches.newest_sealed_sequence()
        watch = ReferenceWatch.objects.filter(pk=1).first() or ReferenceWatch()
        through = min(sealed, watch.through_sequence + batch)
        # (A shared reference is never blank; the filter keeps the types honest.)
        later = [row for row in sealed_sharing(watch.through_sequence, through) if row[2]]
        found = _earlier_namers(later)
        waiting = watch.unrecorded
        recorded = FLAGGING.record(waiting, found)
        refused = recorded.refused
        watch.through_sequence, watch.unrecorded = through, refused
        watch.save()
    if found or waiting:
        log.info(
            "reference watch through_sequence=%d shared=%d flagged=%d unrecorded=%d",
            through, len(later), len(recorded.flagged), len(refused),
        )  # fmt: skip
    return Watched(
        shared=len(later),
        caught_up=through == sealed,
        flagged=recorded.flagged,
        unrecorded=len(refused),
    )


type Naming = tuple[str, int, str]  # an invocation, its runtime, the reference


def sealed_sharing(since: int, through: int) -> QuerySet[Event, Naming]:
    """The events sealed in (since, through] that name a shared reference, in seal
    order: the invocation, its runtime and the reference. Read through their small
    partial index (event_shared_reference_time), never by looking up each sealed event
    of the span in every month's index."""
    return (
        Event.objects.filter(
            NAMES_A_SHARED_REFERENCE, sealed__sequence__gt=since, sealed__sequence__lte=through
        )
        .order_by("sealed__sequence")
        .values_list(
            "invocation__invocation_id", "invocation__runtime_id", "data__business_reference"
        )
    )


def unflagged_namers(references: Iterable[str]) -> QuerySet[Event, tuple[str, str]]:
    """The invocations not flagged `reference_shared` whose evidence names one of these
    references, each with the reference."""
    # Spelled with event_business_reference's own condition so PostgreSQL can use it.
    return (
        Event.objects.filter(HAS_BUSINESS_REFERENCE, data__business_reference__in=set(references))
        .exclude(invocation__flags__contains=[policy.Flag.REFERENCE_SHARED.value])
        .values_list("data__business_reference", "invocation__invocation_id")
        .distinct()
    )


def _earlier_namers(later: list[Naming]) -> list[Entry]:
    """For each event naming a shared reference, the other invocations whose evidence
    names it and that are not flagged yet: one entry each."""
    if not later:
        return []
    namers: dict[str, set[str]] = {}
    for reference, invocation in unflagged_namers(reference for *_, reference in later):
        namers.setdefault(reference, set()).add(invocation)
    found: dict[tuple[str, str, str], Entry] = {}
    for later_one, runtime, reference in later:
        for earlier in sorted(namers.get(reference, set()) - {later_one}):
            found.setdefault(
                (earlier, reference, later_one),
                {
                    "invocation_id": earlier,
                    "business_reference": reference,
                    "named_later_by": later_one,
                    "runtime_id": runtime,
                },
            )
    return list(found.values())


def _flagged(invocation: Invocation, entries: list[Entry]) -> dict[str, Any] | None:
    """Flag the invocation, unless it was flagged since it was read: the data of the
    event saying which references later invocations named too, and which of those
    invocations its runtime may know of."""
    if policy.Flag.REFERENCE_SHARED.value in invocation.flags:
        return None
    invocation.apply_state(policy.with_flag(invocation.state(), policy.Flag.REFERENCE_SHARED))
    by_reference: dict[str, dict[str, int]] = {}
    for entry in entries:
        named = by_reference.setdefault(entry["business_reference"], {})
        named[entry["named_later_by"]] = entry["runtime_id"]
    return {
        "named_later": [
            {"business_reference": reference, **shared_reference_data(named, invocation.runtime_id)}
            for reference, named in sorted(by_reference.items())
        ]
    }


FLAGGING = watches.Flagging(
    actor=WATCH, kind="reference_shared", change=_flagged, log=log, name="reference watch"
)
