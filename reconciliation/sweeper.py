"""The beat's work: flag in-flight attempts past their deadline as missing evidence,
reopen probes whose worker died (or whose lease ran out), and send the probe jobs that
are due."""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import time
from collections.abc import Callable, Collection

from django.conf import settings
from django.core.cache import cache
from django.db.models import F, Q
from django.utils import timezone

from ledger.models import Invocation, InvocationQuerySet
from ledger.services import LedgerError, flag_missing_evidence, flag_missing_evidence_of
from reconciliation import services
from reconciliation.models import ProbeDispatch

log = logging.getLogger(__name__)

# Overdue invocations flagged by one write: large enough that a thousand falling due
# at once take a few statements, small enough that an outcome arriving for one of
# them rarely makes the unit read again.
FLAGS_PER_WRITE = 100


def overdue_invocation_ids(
    *, now: dt.datetime, limit: int, besides: Collection[str] = ()
) -> list[str]:
    """Oldest deadlines first, through the partial index invocation_in_flight_deadline:
    the cost follows the number of in-flight invocations, not the table."""
    return list(
        Invocation.objects.overdue(now)
        .exclude(invocation_id__in=besides)
        .order_by("deadline_at")
        .values_list("invocation_id", flat=True)[:limit]
    )


def sweep(*, now: dt.datetime | None = None, batch: int = 500) -> int:
    """Flag every overdue attempt, `batch` at a time, or as many as
    LEDGER_CATCH_UP_SECONDS allow: the next sweep flags the rest. Returns how many were
    flagged.

    Safe to run anywhere, any number of times, concurrently: flagging is a
    compare-and-set, so an outcome that arrives meanwhile wins and nothing is
    flagged twice.
    """
    until = time.monotonic() + settings.LEDGER_CATCH_UP_SECONDS
    flagged = 0
    # What a round leaves unflagged (an outcome won, or the ledger refused a row that
    # disagrees with its events) is not read again: every round flags or passes over
    # each of its candidates, so the sweep ends, and however many rows are refused,
    # the rest are flagged.
    passed_over: set[str] = set()
    while True:
        # An explicit `now` (tests) also stamps the events; otherwise each unit's
        # flags carry the moment it was made.
        candidates = overdue_invocation_ids(
            now=now or timezone.now(), limit=batch, besides=passed_over
        )
        done = [
            invocation_id
            for unit in itertools.batched(candidates, FLAGS_PER_WRITE)
            for invocation_id in _flag(list(unit), now)
        ]
        flagged += len(done)
        passed_over.update(set(candidates) - set(done))
        if len(candidates) < batch:
            break
        if time.monotonic() >= until:
            log.info("sweep flagged=%d, stopped for the next sweep", flagged)
            return flagged
    if flagged:
        log.info("sweep flagged=%d", flagged)
    return flagged


def _flag(invocation_ids: list[str], now: dt.datetime | None) -> list[str]:
    try:
        return flag_missing_evidence_of(invocation_ids=invocation_ids, now=now)
    except LedgerError:
        # Outcomes kept arriving for this unit, or the ledger refuses one of its
        # invocations: one at a time instead, so that the others are flagged.
        return [i for i in invocation_ids if _one(flag_missing_evidence, i, now)]


def _one(step: Callable[..., bool], invocation_id: str, now: dt.datetime | None) -> bool:
    """`step` for one invocation; a refusal is logged and the sweep goes on, so one
    invocation whose row was tampered with does not stop reconciliation of the rest."""
    try:
        return step(invocation_id=invocation_id, now=now)
    except LedgerError as error:
        if _first_in_a_while((invocation_id, step.__name__, error.type)):
            log.error(
                "sweep skipped invocation=%s step=%s error=%s: %s",
                invocation_id, step.__name__, error.type, error.message,
            )  # fmt: skip
        return False


# A row the ledger refuses stays refused until an admin restores it, and beat sweeps
# every few seconds: the same refusal is logged again only this long after (the
# dashboard and ledger_invocations_overdue_refused count it meanwhile).
LOG_AGAIN_AFTER_SECONDS = 600


def _first_in_a_while(refusal: tuple[str, ...]) -> bool:
    """Whether no sweep has logged the refusal for LOG_AGAIN_AFTER_SECONDS: remembered
    in the cache every process shares (the database's), so that however many workers
    sweep, the refusal is logged once."""
    key = "sweep-refused:" + ":".join(refusal)
    return bool(cache.add(key, True, timeout=LOG_AGAIN_AFTER_SECONDS))


def expire_leases(*, now: dt.datetime | None = None, batch: int = 500) -> int:
    """Reopen invocations whose probe worker died mid-probe."""
    now = now or timezone.now()
    expired = (
        Invocation.objects.lease_expired(now)
        .order_by("lease_expires_at")
        .values_list("invocation_id", flat=True)[:batch]
    )
    return sum(_one(services.expire_lease, i, now) for i in expired)


def release_lost_claims(*, now: dt.datetime | None = None, batch: int = 500) -> int:
    """Reopen invocations whose probe worker is gone (its database session, and with it
    its probe lock, ended) without waiting for their lease to run out."""
    now = now or timezone.now()
    claimed = (
        Invocation.objects.lease_running(now)
        .order_by("lease_expires_at")
        .values_list("invocation_id", flat=True)[:batch]
    )
    lost = services.without_probe_lock(list(claimed))
    return sum(_one(services.release_lost_claim, i, now) for i in sorted(lost))


def due_for_probe(*, now: dt.datetime | None = None, batch: int = 1000) -> list[str]:
    """Flagged invocations whose next probe is due, oldest first."""
    due = _due_for_probe(now or timezone.now())
    return list(due.values_list("invocation_id", flat=True)[:batch])


def _due_for_probe(now: dt.datetime) -> InvocationQuerySet:
    return Invocation.objects.due_for_probe(now).order_by("updated_at")


def send_due_probes(
    send: Callable[[str], object], *, now: dt.datetime | None = None, batch: int = 1000
) -> list[str]:
    """`send` a probe job for each invocation `due_for_probe`, but for those whose last
    job is still on its way (ProbeDispatch); returns the ids sent. Each is marked sent
    after `send` returns: a job sent and not marked is sent again, which does nothing
    twice, while one marked and never sent would wait a lease for nothing."""
    now = now or timezone.now()
    forget_spent_probe_jobs()
    lost_before = now - dt.timedelta(seconds=settings.LEDGER_PROBE_LEASE_SECONDS)
    due = (
        _due_for_probe(now)
        .filter(
            Q(probe_dispatch__isnull=True)
            | Q(probe_dispatch__event_count__lt=F("event_count"))
            | Q(probe_dispatch__sent_at__lte=lost_before)
        )
        .values_list("pk", "invocation_id", "event_count")[:batch]
    )
    sent_ids, sent = [], []
    for pk, invocation_id, event_count in due:
        send(invocation_id)
        sent_ids.append(invocation_id)
        sent.append(ProbeDispatch(invocation_id=pk, sent_at=now, event_count=event_count))
    ProbeDispatch.objects.bulk_create(
        sent,
        update_conflicts=True,
        unique_fields=["invocation"],
        update_fields=["sent_at", "event_count"],
    )
    return sent_ids


def forget_spent_probe_jobs() -> None:
    """Delete the ProbeDispatch rows of jobs that are spent (their invocation has
    gained events since they were sent), so that the table holds only the jobs still
    waiting, not a row for every invocation ever flagged. A spent row never holds a job
    back, so forgetting it changes nothing `send_due_probes` sends."""
    ProbeDispatch.objects.filter(event_count__lt=F("invocation__event_count")).delete()
