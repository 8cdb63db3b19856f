"""Tamper evidence: sealing events and verifying chains, seals and projections."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from operator import itemgetter
from typing import Any, NamedTuple

from django.db import connection, transaction
from django.db.models import Count, Max, Min, Q, QuerySet
from django.utils import timezone

from ledger import capabilities, chain, policy, store
from ledger.models import (
    RECORDED_AT_INTENT,
    AdminAction,
    Capability,
    CapabilityDeclaration,
    Event,
    Invocation,
    Runtime,
    Seal,
    SealedEvent,
    VerificationPass,
)
from ledger.services import LedgerError, event_body, invocation_transition, runtime_actor
from ledger.verify_bundle import merkle_root

# Events are written by single statements that take milliseconds; an event committed
# later than this after it was stamped would be left for a later seal to pick up.
SEAL_LOOKBACK = dt.timedelta(minutes=10)
SEAL_BATCH = 50_000

log = logging.getLogger(__name__)


def seal_body(seal: Seal) -> dict[str, object]:
    return {
        "first_sequence": seal.first_sequence,
        "last_sequence": seal.last_sequence,
        "event_count": seal.event_count,
        "merkle_root": seal.merkle_root,
        "created_at": seal.created_at.astimezone(dt.UTC).isoformat(),
        "prev_hash": seal.prev_hash,
    }


@transaction.atomic
def seal_events(*, now: dt.datetime | None = None) -> Seal | None:
    """Number the committed, unsealed events and checkpoint them in a new seal.

    One sealer at a time (an advisory lock); None when there is nothing new.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext('ledger.seal_events'))")
    now = now or timezone.now()
    last = Seal.objects.order_by("-last_sequence").first()
    unsealed = Event.objects.filter(sealed__isnull=True)
    if last is not None:
        # Committed since the last seal: stamped after its lookback, or inserted after
        # the first event it sealed. Ids are drawn at insert, moments before commit,
        # so the second catches what the first misses: events stamped by a web host
        # whose clock is behind the sealer's.
        first_of_last = SealedEvent.objects.filter(sequence__gte=last.first_sequence).aggregate(
            id=Min("event_id")
        )["id"]
        unsealed = unsealed.filter(
            Q(created_at__gte=last.created_at - SEAL_LOOKBACK) | Q(id__gte=first_of_last)
        )
    events = list(
        unsealed.order_by("created_at", "id").values_list("id", "hash", "invocation_created_at")[
            :SEAL_BATCH
        ]
    )
    if not events:
        return None
    first = (last.last_sequence if last else 0) + 1
    seal = Seal(
        first_sequence=first,
        last_sequence=first + len(events) - 1,
        event_count=len(events),
        merkle_root=merkle_root(h for _, h, _ in events),
        created_at=now,
        prev_hash=last.hash if last else chain.GENESIS_HASH,
    )
    seal.hash = chain.event_hash(seal.prev_hash, seal_body(seal))
    seal.save()
    SealedEvent.objects.bulk_create(
        SealedEvent(
            sequence=first + i,
            event_id=event_id,
            event_invocation_created_at=partition_key,
            seal=seal,
        )
        for i, (event_id, _, partition_key) in enumerate(events)
    )
    return seal


@dataclass
class Break:
    # "chain", "transition", "seal", "projection", "action" (the action log) or
    # "capability" (a capability or a declaration against the action log)
    what: str
    where: str
    expected: str
    found: str

    def __str__(self) -> str:
        return f"{self.what} broken at {self.where}: expected {self.expected}, found {self.found}"

    @property
    def invocation_id(self) -> str | None:
        """The invocation a chain, replay or row break is in (an id holds no blank)."""
        first, _, rest = self.where.partition(" ")
        return rest.split(" ", 1)[0] if first == "invocation" else None


@dataclass
class Report:
    invocations: int = 0
    events: int = 0
    seals: int = 0
    projections: int = 0
    admin_actions: int = 0
    capabilities: int = 0
    projections_checked: bool = False
    breaks: list[Break] = field(default_factory=list)
    # The newest seal verified: its hash, compared with the one the sealer logged
    # (ledger.tasks), shows whether the database's seal chain is the one it made.
    newest_seal: Seal | None = None

    @property
    def ok(self) -> bool:
        return not self.breaks

    @property
    def histories_unexplained(self) -> bool:
        """Some intact chain records a history no rule of the retry policy leads to."""
        return any(broken.what == "transition" for broken in self.breaks)

    @property
    def projections_broken(self) -> bool:
        """Some row disagrees with its events (restore_projection puts it back)."""
        return any(broken.what == "projection" for broken in self.breaks)

    @property
    def summary(self) -> str:
        """What was verified, as people say it: "4 invocations, 1 seal, … and 2
        capabilities"."""
        counts = [
            counted(self.invocations, "invocation"),
            counted(self.events, "event"),
            counted(self.seals, "seal"),
            *([counted(self.projections, "projection")] if self.projections_checked else []),
            counted(self.admin_actions, "admin action"),
            counted(self.capabilities, "capability", "capabilities"),
        ]
        return f"{', '.join(counts[:-1])} and {counts[-1]}"

    @property
    def capabilities_unrecorded(self) -> bool:
        """Some capability or declaration is not what the action log recorded."""
        return any(broken.what == "capability" for broken in self.breaks)


def counted(number: int, noun: str, plural: str = "") -> str:
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


# An event as verification reads it: the model (one invocation's), or the columns of
# a PlainEvent (many invocations', where building models would cost more than hashing).
type Link = Event | store.PlainEvent
LINK_FIELDS = [f.name for f in fields(store.PlainEvent)]


class Chain(NamedTuple):
    """An invocation's events and what its row says of them, read in one statement."""

    pk: int
    invocation_id: str
    event_count: int
    head_hash: str
    links: Sequence[Link]


def _link_breaks(invocation_id: str, events: Sequence[Link]) -> Iterator[Break]:
    """The first broken link among the events themselves, if any."""
    prev = chain.GENESIS_HASH
    for expected_seq, event in enumerate(events, start=1):
        where = f"invocation {invocation_id} event #{expected_seq}"
        if event.seq != expected_seq:
            yield Break("chain", where, f"seq {expected_seq}", f"seq {event.seq}")
            return
        if event.prev_hash != prev:
            yield Break("chain", where, f"prev_hash {prev}", f"prev_hash {event.prev_hash}")
            return
        computed = chain.event_hash(event.prev_hash, event_body(event, invocation_id))
        if computed != event.hash:
            yield Break("chain", where, f"hash {computed}", f"hash {event.hash}")
            return
        prev = event.hash


def _chain_breaks(chained: Chain) -> Iterator[Break]:
    broken = list(_link_breaks(chained.invocation_id, chained.links))
    yield from broken
    last = chained.links[-1]
    if not broken and _head_differs(chained, last):
        yield Break(
            "chain",
            f"invocation {chained.invocation_id} head",
            f"{len(chained.links)} events ending {last.hash}",
            f"{chained.event_count} events ending {chained.head_hash}",
        )


# What the command and the page tell whoever finds an unexplained history.
UNEXPLAINED_HISTORY_ADVICE = (
    "A history the retry policy does not explain, with every hash intact, was written "
    "around the ledger (its hashes recomputed) or by a faulty release: compare its events "
    "with a backup and, where sealed, with the sealer's logged seal hashes. "
    "restore_projection does not repair it: the row would be put back to that history."
)


def _transition_breaks(invocation_id: str, events: Sequence[Link]) -> Iterator[Break]:
    """The first recorded state the retry policy does not lead to (policy.replay)."""
    unexplained = policy.replay((event.seq, event.kind, event.data) for event in events)
    if unexplained is not None:
        where = f"invocation {invocation_id} event #{unexplained.seq}"
        yield Break("transition", where, unexplained.expected, unexplained.found)


def _head_differs(row: Invocation | Chain, last: Link) -> bool:
    """Whether the row counts another event than `last` as its last."""
    return (row.event_count, row.head_hash) != (last.seq, last.hash)


def _projection_breaks(invocation: Invocation, events: Sequence[Link]) -> Iterator[Break]:
    """The projection must equal the state the last event recorded, and the columns
    fixed at intent time what the intent recorded."""
    for name, (recorded, found) in _differences(invocation, events).items():
        yield Break(
            "projection",
            f"invocation {invocation.invocation_id} {name}",
            repr(recorded),
            repr(found),
        )


def _differences(invocation: Invocation, events: Sequence[Link]) -> dict[str, tuple[Any, Any]]:
    """The row's columns that differ from its chain's: (recorded, found). The runtime
    is compared as the actor who recorded the intent."""
    intent = events[0] if events[0].seq == 1 else None
    differences = invocation.differences_from(
        events[-1].data.get("state", {}), intent.data if intent else {}
    )
    owner = runtime_actor(invocation.runtime)
    if intent is not None and intent.actor != owner:
        differences["runtime"] = (intent.actor, owner)
    return differences


def _runtime_acting_as(actor: str) -> Runtime:
    """The runtime whose actor is `actor`: names never change (a trigger refuses it)."""
    return Runtime.objects.get(name=actor.removeprefix("runtime:"))


def restore_projection(*, invocation_id: str, actor: str, reason: str) -> dict[str, Any]:
    """Put an invocation's row back to what its events say, with an event that records
    the restoring: each field found changed, what was found and what the events say.
    Returns that event's `restored` (empty, and nothing written, when the row agrees).

    The chain of events must verify first. A row is restored from intact evidence
    only; a broken chain is for a person to take up with backups and the sealer's
    logged hashes, and is refused here (409 chain_broken, nothing written). Columns
    that no event records (deadline, lease, claim) are left as they are.
    """
    restored: dict[str, Any] = {}

    def change(invocation: Invocation) -> dict[str, Any] | None:
        # Read inside the unit: if an event is appended meanwhile, the write loses its
        # race and this is asked again with that event.
        events = list(Event.objects.of(invocation).order_by("seq", "id"))
        broken = next(_link_breaks(invocation_id, events), None)
        if broken is not None or not events:
            where = broken or f"invocation {invocation_id}: it has no events"
            raise LedgerError(
                "chain_broken",
                f"{where}. The row was not restored from a broken chain.",
                status=409,
            )
        last = events[-1]
        restored.clear()
        fixed_at_intent: dict[str, Any] = {}
        for name, (recorded, found) in _differences(invocation, events).items():
            restored[name] = {"found": found, "recorded": recorded}
            if name == "runtime":
                fixed_at_intent["runtime"] = _runtime_acting_as(recorded)
                continue
            blank = "" if name in policy.BLANK_AS_NULL else recorded
            setattr(invocation, name, recorded if recorded is not None else blank)
            if name in RECORDED_AT_INTENT:
                fixed_at_intent[name] = recorded
        if fixed_at_intent:
            # The unit's write changes only the projection's columns; these are put back
            # here, in its transaction.
            Invocation.objects.filter(pk=invocation.pk).update(**fixed_at_intent)
        if _head_differs(invocation, last):
            restored["head"] = {
                "found": [invocation.event_count, invocation.head_hash],
                "recorded": [last.seq, last.hash],
            }
            invocation.event_count, invocation.head_hash = last.seq, last.hash
        if not restored:
            return None
        return {"reason": reason, "restored": restored}

    invocation_transition(
        invocation_id=invocation_id,
        actor=actor,
        kind="projection_restored",
        change=change,
        checks_projection=False,
    )
    return restored


def time_window(since: dt.datetime | None, until: dt.datetime | None) -> Q:
    """Rows created in [since, until); either end may be open."""
    window = Q()
    if since:
        window &= Q(created_at__gte=since)
    if until:
        window &= Q(created_at__lt=until)
    return window


def more_events_than(limit: int, *, since: dt.datetime | None, until: dt.datetime | None) -> bool:
    """Whether more than `limit` events were created in [since, until); counts no
    further than limit + 1."""
    in_range = Event.objects.filter(time_window(since, until)).order_by().values("pk")
    return in_range[: limit + 1].count() > limit


def chains_touched(events: QuerySet[Event]) -> QuerySet[Event]:
    """Every event of each chain that one of `events` is in.

    An invocation's events are all in its own month's partition, so the chains are
    read in the months of the invocations touched only, with those invocations'
    rows. Told nothing of their months, PostgreSQL merged every month's events in
    invocation order up to the last invocation touched: verifying the last fortnight
    of `bench_audit`'s million took 1.20-1.94 s, against 1.04-1.38 s with its months.
    """
    span = events.aggregate(first=Min("invocation_created_at"), last=Max("invocation_created_at"))
    if span["first"] is None:
        return Event.objects.none()
    months = (span["first"], span["last"])
    return Event.objects.filter(
        invocation__in=events.values("invocation_id").distinct(),
        invocation_created_at__range=months,
        invocation__created_at__range=months,
    )


@contextmanager
def reading_every_row() -> Iterator[None]:
    """Server-side cursors opened inside read every row: planned for that, rather than
    for the first tenth of the rows as PostgreSQL plans a cursor by default (with
    which `chains_touched` read a fortnight's chains in 0.70-0.80 s, against
    0.34-0.63 s)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('cursor_tuple_fraction')")
        (planned_for,) = cursor.fetchone()
        cursor.execute("SET LOCAL cursor_tuple_fraction = 1")
        yield
        # An outer transaction goes on as it was planning. (Rolled back, the savepoint
        # takes the setting back with it.)
        cursor.execute("SELECT set_config('cursor_tuple_fraction', %s, true)", [planned_for])


def verify(
    *,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    projections: bool = False,
) -> Report:
    """Recompute every chain with events in the range, replay its recorded states
    through the retry policy, check every seal and every action of the action log in
    the range, every capability against the action log and (optionally) every
    projection; collect each break, first per invocation."""
    report = Report(projections_checked=projections)
    window = time_window(since, until)
    # A range reads the chains it touches; no range, every chain (touched by itself).
    chains = chains_touched(Event.objects.filter(window)) if window else Event.objects.all()
    with reading_every_row():
        _check_chains(report, chains, projections=projections)
    seals = Seal.objects.filter(window).order_by("first_sequence")
    previous = Seal.objects.filter(first_sequence__lt=seals.values("first_sequence")[:1])
    prev_hash = previous.order_by("-first_sequence").values_list("hash", flat=True).first()
    _check_seals(report, seals, prev_hash)
    actions = AdminAction.objects.filter(window).order_by("id")
    first = actions.values_list("id", flat=True).first()
    if first is not None:
        before = AdminAction.objects.filter(id__lt=first).order_by("-id")
        prev_hash = before.values_list("hash", flat=True).first() or chain.GENESIS_HASH
        _check_admin_actions(report, actions.iterator(), prev_hash)
    _check_capabilities(report)
    return report


# Invocations whose rows a projection check reads in one query.
ROWS_READ_TOGETHER = 1000


def _chains(events: QuerySet[Event]) -> Iterator[Chain]:
    """Every chain of `events`, in one streamed query grouped here: a query per
    invocation would cost more than the hashing. Rows, not models: building an event,
    its invocation and their runtime for every event took twice the hashing's time."""
    streamed = (
        events.order_by("invocation_id", "seq", "id")
        .values_list(
            "invocation_id",
            "invocation__invocation_id",
            "invocation__event_count",
            "invocation__head_hash",
            *LINK_FIELDS,
        )
        .iterator(chunk_size=5000)
    )
    for (pk, invocation_id, count, head_hash), rows in itertools.groupby(
        streamed, key=itemgetter(0, 1, 2, 3)
    ):
        yield Chain(
            pk, invocation_id, count, head_hash, [store.PlainEvent(*row[4:]) for row in rows]
        )


def _check_chains(report: Report, events: QuerySet[Event], *, projections: bool) -> set[int]:
    """Check each chain of `events` into the report; the invocations (pks) seen."""
    seen = set()
    for batch in itertools.batched(_chains(events), ROWS_READ_TOGETHER):
        rows: dict[int, Invocation] = {}
        if projections:
            rows = Invocation.objects.select_related("runtime").in_bulk([c.pk for c in batch])
        for chained in batch:
            row = rows.get(chained.pk)
            if projections and (row is None or row.event_count != chained.event_count):
                # An event was appended after its chain was read: the row is compared
                # with a chain of its own moment, read with it.
                chained, row = _chain_with_row(events.filter(invocation_id=chained.pk))
            seen.add(chained.pk)
            report.invocations += 1
            report.events += len(chained.links)
            broken = list(_chain_breaks(chained))
            # A chain broken is the finding; a replay of altered events would repeat it.
            report.breaks.extend(broken or _transition_breaks(chained.invocation_id, chained.links))
            if row is not None:
                report.projections += 1
                report.breaks.extend(_projection_breaks(row, chained.links))
    return seen


def _chain_with_row(events: QuerySet[Event]) -> tuple[Chain, Invocation]:
    """One invocation's chain and row, read in one statement."""
    read = list(events.select_related("invocation__runtime").order_by("seq", "id"))
    invocation = read[0].invocation
    chained = Chain(
        invocation.pk, invocation.invocation_id, invocation.event_count, invocation.head_hash, read
    )
    return chained, invocation


def _check_seals(report: Report, seals: Iterable[Seal], prev_hash: str | None) -> None:
    """Check each seal into the report, the first against `prev_hash` (None: not
    checked)."""
    for seal in seals:
        report.seals += 1
        where = f"seal {seal.pk} (sequence {seal.first_sequence}-{seal.last_sequence})"
        if prev_hash is not None and seal.prev_hash != prev_hash:
            report.breaks.append(Break("seal", where, f"prev_hash {prev_hash}", seal.prev_hash))
        leaves = list(
            SealedEvent.objects.filter(seal=seal)
            .with_events()
            .order_by("sequence")
            # (django-stubs does not know the FilteredRelation's name.)
            .values_list("partitioned_event__hash", flat=True)  # type: ignore[misc]
        )
        root = merkle_root(leaves)
        if len(leaves) != seal.event_count or root != seal.merkle_root:
            report.breaks.append(
                Break(
                    "seal",
                    where,
                    f"root {seal.merkle_root}",
                    f"root {root} over {len(leaves)} events",
                )
            )
        computed = chain.event_hash(seal.prev_hash, seal_body(seal))
        if computed != seal.hash:
            report.breaks.append(Break("seal", where, f"hash {computed}", f"hash {seal.hash}"))
        prev_hash = seal.hash
        report.newest_seal = seal


def _check_admin_actions(report: Report, actions: Iterable[AdminAction], prev_hash: str) -> None:
    """Check each action of the action log's chain into the report, the first against
    `prev_hash`: a row rewritten breaks its hash, a row taken out the next one's link."""
    for action in actions:
        report.admin_actions += 1
        where = f"admin action {action.pk}"
        if action.prev_hash != prev_hash:
            report.breaks.append(
                Break("action", where, f"prev_hash {prev_hash}", f"prev_hash {action.prev_hash}")
            )
        computed = chain.event_hash(action.prev_hash, action.body())
        if computed != action.hash:
            report.breaks.append(Break("action", where, f"hash {computed}", f"hash {action.hash}"))
        prev_hash = action.hash


CAPABILITY_ADVICE = (
    "A capability that differs from the action log was changed outside the registry, "
    "which records every registration and settings change there. Find out who changed "
    "it, then put it back on the record: import its declaration again (registered as a "
    "new version) and set its settings back in the admin, with a reason. A declaration "
    "of its history that was rewritten or taken out is evidence lost: restore it from a "
    "backup."
)


def _check_capabilities(report: Report) -> None:
    """Check every declaration, and every capability row, against what the action log
    recorded of the registry (ledger.capabilities): the declarations' digests, the
    fields derived from the newest one, and the settings the last change left (the
    defaults when none). The log's own chain is _check_admin_actions'."""
    registrations: dict[tuple[str, Any], AdminAction] = {}
    newest: dict[str, AdminAction] = {}
    settings: dict[str, dict[str, Any]] = {}
    recorded = AdminAction.objects.filter(
        action__in=(capabilities.DECLARATION_REGISTERED, capabilities.SETTINGS_CHANGED)
    )
    for action in recorded.order_by("id").iterator():
        if action.action == capabilities.SETTINGS_CHANGED:
            settings[action.target] = action.details.get("settings")
            continue
        registrations[(action.target, action.details.get("version"))] = action
        newest[action.target] = action  # versions are registered in order
    declarations = CapabilityDeclaration.objects.select_related("capability")
    for declaration in declarations.order_by("capability__scope", "version").iterator():
        scope = declaration.capability.scope
        where = f"capability {scope} declaration v{declaration.version}"
        registered = registrations.pop((scope, declaration.version), None)
        expected = registered.details.get("digest") if registered else None
        found = chain.digest(declaration.declaration)
        if expected != found:
            report.breaks.append(
                Break("capability", where, f"digest {expected or 'of none registered'}", found)
            )
    for scope, version in registrations:
        where = f"capability {scope} declaration v{version}"
        report.breaks.append(Break("capability", where, "the declaration registered", "none"))

    for capability in Capability.objects.order_by("scope").iterator():
        report.capabilities += 1
        registration = newest.get(capability.scope)
        recorded_row: dict[str, Any] = (
            {
                "version": registration.details.get("version"),
                "declaration": registration.details.get("digest"),
                **registration.details.get("fields", {}),
            }
            if registration
            # No declaration registered: only the registry makes capabilities, so a
            # row it did not make is one with nothing to govern by.
            else {"version": 0, "declaration": chain.digest({}), **capabilities.UNDECLARED_FIELDS}
        )
        # A change recorded before a setting existed left that setting at its default.
        recorded_row.update(capabilities.DEFAULT_SETTINGS)
        recorded_row.update(settings.get(capability.scope, {}))
        row = {
            "version": capability.version,
            "declaration": chain.digest(capability.declaration),
            **capabilities.declared_fields_of(capability),
            **capabilities.settings_of(capability),
        }
        differing = sorted(name for name in recorded_row if recorded_row[name] != row[name])
        if differing:
            report.breaks.append(
                Break(
                    "capability",
                    f"capability {capability.scope}",
                    ", ".join(f"{name} {json.dumps(recorded_row[name])}" for name in differing),
                    ", ".join(f"{name} {json.dumps(row[name])}" for name in differing),
                )
            )


# Background verification ----------------------------------------------------------

# Seals are read a page at a time and checked up to SEAL_BATCH events a slice (at
# least one seal, however large): a seal's check reads every event it sealed.
SEALS_READ = 1000
# The action log is checked this many rows a slice (they are few: tokens issued and
# revoked).
ADMIN_ACTIONS_READ = 10_000
# Passes that found nothing are kept this many; those that found a break, all.
CLEAN_PASSES_KEPT = 100


@transaction.atomic
def verify_next_slice(
    *, invocations: int, now: dt.datetime | None = None
) -> VerificationPass | None:
    """Verify the running pass's next `invocations` invocations (chains, replays and
    rows), its next seals and its next rows of the action log, starting a pass if
    none runs; None when another run holds the lock. The pass is finished when it has
    reached the ends it started with.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(hashtext('ledger.verify_next_slice'))")
        if not cursor.fetchone()[0]:
            return None
    now = now or timezone.now()
    running = VerificationPass.objects.filter(finished_at=None).first()
    report = Report()
    if running is None:
        running = _start_pass(now)
        # Capabilities are few: the pass's first slice checks them all.
        _check_capabilities(report)

    in_order = list(
        Invocation.objects.filter(pk__gt=running.after_invocation, pk__lte=running.until_invocation)
        .order_by("pk")
        .values_list("pk", "invocation_id", "created_at")[:invocations]
    )
    ids = {pk: invocation_id for pk, invocation_id, _ in in_order}
    if ids:
        first, last = min(ids), max(ids)
        recorded = [created_at for *_, created_at in in_order]
        # The slice's months only (their partition key): an event in another month
        # than its invocation's is missing from its chain here, and reported so.
        in_slice = Event.objects.filter(
            invocation_id__gte=first,
            invocation_id__lte=last,
            invocation_created_at__gte=min(recorded),
            invocation_created_at__lte=max(recorded),
        )
        seen = _check_chains(report, in_slice, projections=True)
        for pk in sorted(ids.keys() - seen):
            # The events table refuses DELETE: a superuser switched its trigger off.
            report.breaks.append(
                Break("chain", f"invocation {ids[pk]}", "its intent event at least", "no event")
            )
            report.invocations += 1
        running.after_invocation = last

    seals, more_seals = _next_seals(running)
    if seals:
        _check_seals(report, seals, running.after_seal_hash)
        running.after_seal, running.after_seal_hash = seals[-1].first_sequence, seals[-1].hash

    actions = list(
        AdminAction.objects.filter(
            id__gt=running.after_admin_action, id__lte=running.until_admin_action
        ).order_by("id")[:ADMIN_ACTIONS_READ]
    )
    if actions:
        _check_admin_actions(report, actions, running.after_admin_action_hash)
        running.after_admin_action = actions[-1].pk
        running.after_admin_action_hash = actions[-1].hash
    more_actions = len(actions) == ADMIN_ACTIONS_READ

    running.invocations += report.invocations
    running.events += report.events
    running.seals += report.seals
    running.admin_actions += report.admin_actions
    running.capabilities += report.capabilities
    running.break_count += len(report.breaks)
    room = VerificationPass.BREAKS_KEPT - len(running.breaks)
    running.breaks += [
        {"break": str(broken), "invocation_id": broken.invocation_id}
        for broken in report.breaks[: max(room, 0)]
    ]
    running.checked_at = now
    reached_the_end = running.after_invocation >= running.until_invocation
    if (reached_the_end or len(ids) < invocations) and not (more_seals or more_actions):
        running.finished_at = now
    running.save()
    for broken in report.breaks:
        log.error("verification pass=%d %s", running.pk, broken)
    if running.finished_at:
        log.info(
            "verification pass=%d finished invocations=%d events=%d seals=%d "
            "admin_actions=%d capabilities=%d breaks=%d",
            running.pk,
            running.invocations,
            running.events,
            running.seals,
            running.admin_actions,
            running.capabilities,
            running.break_count,
        )
    return running


def verify_slices_for(*, seconds: float, invocations: int) -> int:
    """Slices of `invocations` (`verify_next_slice`, a transaction each, so that no
    lock or snapshot is held for long) until `seconds` have passed, the running pass
    has finished, or another run holds the lock; how many slices were checked. At
    least one: `seconds=0` is a slice a run. A finished pass ends the run: a small
    ledger is verified once an interval, not over and over."""
    deadline = time.monotonic() + seconds
    slices = 0
    while (verified := verify_next_slice(invocations=invocations)) is not None:
        slices += 1
        if verified.finished_at is not None or time.monotonic() >= deadline:
            break
    return slices


def newest_passes() -> tuple[VerificationPass | None, VerificationPass | None]:
    """The background verification pass running, if one is, and the last finished."""
    passes = list(VerificationPass.objects.order_by("-started_at")[:2])
    running = passes[0] if passes and passes[0].finished_at is None else None
    finished = next((p for p in passes if p.finished_at is not None), None)
    return running, finished


def _start_pass(now: dt.datetime) -> VerificationPass:
    """A new pass up to the newest invocation and seal; old clean passes forgotten."""
    kept = VerificationPass.objects.filter(break_count=0).order_by("-started_at")
    VerificationPass.objects.filter(
        break_count=0, pk__in=kept.values("pk")[CLEAN_PASSES_KEPT - 1 :]
    ).delete()
    newest_seal = Seal.objects.aggregate(at=Max("first_sequence"))["at"]
    # Counted once a pass: at a million, 50 ms of an index scan (0.2 s with a cold cache).
    invocations = Invocation.objects.aggregate(at=Max("pk"), count=Count("pk"))
    return VerificationPass.objects.create(
        started_at=now,
        checked_at=now,
        until_invocation=invocations["at"] or 0,
        invocations_to_check=invocations["count"],
        until_seal=newest_seal or 0,
        until_admin_action=AdminAction.objects.aggregate(at=Max("pk"))["at"] or 0,
    )


def _next_seals(running: VerificationPass) -> tuple[list[Seal], bool]:
    """The pass's next seals, up to SEAL_BATCH events (at least one seal), and whether
    more are left after them."""
    page = list(
        Seal.objects.filter(
            first_sequence__gt=running.after_seal, first_sequence__lte=running.until_seal
        ).order_by("first_sequence")[:SEALS_READ]
    )
    taken: list[Seal] = []
    events = 0
    for seal in page:
        if taken and events + seal.event_count > SEAL_BATCH:
            return taken, True
        taken.append(seal)
        events += seal.event_count
    return taken, len(page) == SEALS_READ
