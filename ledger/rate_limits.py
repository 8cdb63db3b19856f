"""The rate-limit watch: attempts admitted beyond a capability's declared rate.

ACC v1 lets a capability declare `execution.rate_limit` (`count` per `window`). By
default the ledger does not refuse an admission for it: counting admissions at
admission time serializes every admission of the capability, on the one path kept to
a single statement (for a capability whose `rate_limit_enforced` setting is on, it
does: `ledger.rate_enforcement`). Instead beat's task reads the events the sealer has
numbered since it last read, and each attempt admitted when `count` others of the
same capability had been admitted within the `window` before it (a sliding window, by
the ledger's clock, across every runtime: the limit is the business system's) flags
its invocation `rate_limit_exceeded`, with an event saying which attempt and how many
were admitted in that window. Only admissions since the declaration that set the limit
was registered are judged or counted. Compliance finds the flagged invocations by the
flag.

The watch follows the seal sequence, so each committed admission is judged once, and
its cursor moves in the transaction that records what it found: a run killed halfway
records nothing, and the next run reads the same events again.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime as dt
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from ledger import policy, watches
from ledger.models import (
    Capability,
    CapabilityDeclaration,
    Invocation,
    RateWatch,
    Seal,
    SealedEvent,
)
from ledger.rate_enforcement import RateLimit
from ledger.watches import Entry

log = logging.getLogger(__name__)

WATCH = "ledger:rate_watch"
# Sealed events (of every kind) one run reads through: a run with more to read leaves
# them to the next, in the same beat task (ledger.tasks), each in its own transaction.
# A span of sequence numbers rather than a LIMIT on the rows found, because a LIMIT let
# PostgreSQL read the whole rest of the range, and sort it, for each batch it returned.
BATCH = 100_000


@dataclass(frozen=True)
class Admission:
    at: dt.datetime
    invocation_id: str
    attempt_id: str


@dataclass(frozen=True)
class Breach:
    admission: Admission
    # Admissions of the capability in the window that ends at this one, itself included.
    in_window: int

    def as_entry(self, scope: str, limit: RateLimit) -> dict[str, Any]:
        """The breach as it waits to be recorded (JSON: RateWatch.unrecorded keeps it)."""
        return {
            "scope": scope,
            "rate_limit": dict(limit.declared),
            "invocation_id": self.admission.invocation_id,
            "attempt_id": self.admission.attempt_id,
            "admitted_at": self.admission.at.isoformat(),
            "admitted_in_window": self.in_window,
        }


def breaches(
    earlier: Sequence[dt.datetime], admissions: Sequence[Admission], limit: RateLimit
) -> tuple[list[Breach], list[dt.datetime]]:
    """The admissions, in time order, that `limit` was exceeded by, given the `earlier`
    admission times of the capability; and the times to remember for the next call.

    An admission at `t` exceeds the limit when more than `count` admissions, itself
    included, fall in the window (t - window, t]. Judging later ones needs no more of
    the past than the newest `count` times within one window of the newest.
    """
    times = sorted(earlier)
    found = []
    for admission in sorted(admissions, key=lambda a: a.at):
        bisect.insort(times, admission.at)
        in_window = bisect.bisect_right(times, admission.at) - bisect.bisect_right(
            times, admission.at - limit.window
        )
        if in_window > limit.count:
            found.append(Breach(admission, in_window))
    if not times:
        return found, []
    oldest_needed = times[-1] - limit.window
    return found, [t for t in times[-limit.count :] if t > oldest_needed]


@dataclass(frozen=True)
class Watched:
    admissions: int
    # False when the run stopped a batch short of the newest seal: more events wait.
    caught_up: bool
    breaches: int
    flagged: list[str]
    unrecorded: int


def watch_rate_limits(*, batch: int | None = None) -> Watched:
    """Judge the admissions sealed since the last run, within `batch` (BATCH) sealed
    events of the furthest-behind watch, against their capabilities' declared rate
    limits, and flag the invocations of those beyond them."""
    batch = batch or BATCH
    with transaction.atomic():
        watches.exclusive("ledger.watch_rate_limits")
        sealed = watches.newest_sealed_sequence()
        limits = _declared_limits()
        kept = RateWatch.objects.in_bulk()
        for scope, limit in limits.items():
            kept[scope] = _started(kept.get(scope), scope, limit)
        for scope, watch in kept.items():
            if scope not in limits:
                watch.watching, watch.rate_limit, watch.admissions = False, {}, []
        watching = {scope: kept[scope] for scope in limits}
        since = min((watch.through_sequence for watch in watching.values()), default=sealed)
        through = min(sealed, since + batch)
        read = _sealed_admissions(watching, since, through)
        found: list[dict[str, Any]] = []
        for scope, watch in watching.items():
            new = [
                Admission(at, invocation_id, attempt_id)
                for sequence, at, invocation_id, of_scope, attempt_id in read
                if of_scope == scope and sequence > watch.through_sequence and at >= watch.since
            ]
            exceeded, watch.admissions = breaches(watch.admissions, new, limits[scope])
            found += [breach.as_entry(scope, limits[scope]) for breach in exceeded]
            watch.through_sequence = max(watch.through_sequence, through)
        # Breaches found before a limit was withdrawn are still recorded.
        waiting = [entry for watch in kept.values() for entry in watch.unrecorded]
        recorded = FLAGGING.record(waiting, found)
        refused = recorded.refused
        for watch in kept.values():
            watch.unrecorded = [entry for entry in refused if entry["scope"] == watch.scope]
        _save(kept.values())
    if found or waiting:
        log.info(
            "rate watch through_sequence=%d breaches=%d flagged=%d unrecorded=%d",
            through, len(found), len(recorded.flagged), len(refused),
        )  # fmt: skip
    return Watched(
        admissions=len(read),
        caught_up=through == sealed,
        breaches=len(found),
        flagged=recorded.flagged,
        unrecorded=len(refused),
    )


def _started(watch: RateWatch | None, scope: str, limit: RateLimit) -> RateWatch:
    """The watch of a declared limit: as it was, or (re)started for a limit newly
    declared or changed, remembering nothing from before its declaration."""
    if watch is not None and watch.watching and watch.rate_limit == limit.declared:
        return watch
    since = limit.since or timezone.now()
    if watch is None or not watch.watching:
        # From the seals made before the declaration: they hold no admission since.
        before = (
            Seal.objects.filter(created_at__lt=since)
            .order_by("-last_sequence")
            .values_list("last_sequence", flat=True)
            .first()
        )
        through = max(before or 0, watch.through_sequence if watch else 0)
    else:
        # A changed limit: what was read was judged by the one before.
        through = watch.through_sequence
    return RateWatch(
        scope=scope,
        rate_limit=dict(limit.declared),
        since=since,
        through_sequence=through,
        unrecorded=watch.unrecorded if watch else [],
    )


def _save(rows: Iterable[RateWatch]) -> None:
    """Keep the watches of declared limits, and of withdrawn ones only while breaches
    found under them wait to be recorded."""
    kept = [watch for watch in rows if watch.watching or watch.unrecorded]
    RateWatch.objects.exclude(scope__in=[watch.scope for watch in kept]).delete()
    RateWatch.objects.bulk_create(
        kept,
        update_conflicts=True,
        unique_fields=["scope"],
        update_fields=[
            "rate_limit",
            "since",
            "through_sequence",
            "admissions",
            "unrecorded",
            "watching",
        ],
    )


def _declared_limits() -> dict[str, RateLimit]:
    declaring = Capability.objects.filter(declaration__execution__has_key="rate_limit").annotate(
        registered_at=Subquery(
            CapabilityDeclaration.objects.filter(
                capability=OuterRef("pk"), version=OuterRef("version")
            ).values("created_at")[:1]
        )
    )
    return {
        scope: dataclasses.replace(limit, since=registered_at)
        for scope, declaration, registered_at in declaring.values_list(
            "scope", "declaration", "registered_at"
        )
        if (limit := RateLimit.declared_by(declaration)) is not None
    }


type SealedAdmission = tuple[int, dt.datetime, str, str, str]


def _sealed_admissions(
    watching: Mapping[str, RateWatch], since: int, through: int
) -> list[SealedAdmission]:
    """The admissions of the watched capabilities sealed in (since, through], in seal
    order: sequence, time, invocation, scope and attempt."""
    if not watching:
        return []
    # (django-stubs does not know a FilteredRelation's name: with_events' partitioned_event.)
    rows = (
        SealedEvent.objects.with_events()
        .filter(  # type: ignore[misc]
            sequence__gt=since,
            sequence__lte=through,
            partitioned_event__kind="attempt_admitted",
            partitioned_event__invocation__capability_scope__in=list(watching),
        )
        .order_by("sequence")
        .values_list(
            "sequence",
            "partitioned_event__created_at",
            "partitioned_event__invocation__invocation_id",
            "partitioned_event__invocation__capability_scope",
            "partitioned_event__data__attempt_id",
        )
    )
    return list(rows)


def _flagged(invocation: Invocation, entries: list[Entry]) -> dict[str, Any]:
    """Flag the invocation: the data of the event recording its breaches."""
    invocation.apply_state(policy.with_flag(invocation.state(), policy.Flag.RATE_LIMIT_EXCEEDED))
    return {
        "rate_limit": entries[0]["rate_limit"],
        "attempts": [
            {name: entry[name] for name in ("attempt_id", "admitted_at", "admitted_in_window")}
            for entry in entries
        ],
    }


FLAGGING = watches.Flagging(
    actor=WATCH, kind="rate_limit_exceeded", change=_flagged, log=log, name="rate watch"
)
