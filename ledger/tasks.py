from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from celery import shared_task
from django.conf import settings

from ledger import anchors, integrity, partitions, rate_limits, shared_references
from ledger.integrity import seal_events, verify_slices_for

log = logging.getLogger(__name__)


@shared_task(acks_late=True, ignore_result=True)
def seal_new_events() -> int:
    """Beat runs this every LEDGER_SEAL_INTERVAL_SECONDS; returns how many were sealed.

    A seal holds at most SEAL_BATCH events, and a full one means more wait: the run
    seals again until it has caught up, or for LEDGER_CATCH_UP_SECONDS, so that a ledger
    recording more than SEAL_BATCH events an interval (a busy batch endpoint writes that
    many in seconds) is not left further behind at every interval.

    Each seal's hash also goes to the log: kept by whatever collects the logs, outside
    the database, it anchors the seal chain (and evidence bundles, `verify_bundle
    --seal`) against someone who could rewrite the database, hashes and all.
    """
    sealed = 0
    until = time.monotonic() + settings.LEDGER_CATCH_UP_SECONDS
    while (seal := seal_events()) is not None:
        log.info(
            "sealed first_sequence=%d last_sequence=%d events=%d merkle_root=%s hash=%s",
            seal.first_sequence,
            seal.last_sequence,
            seal.event_count,
            seal.merkle_root,
            seal.hash,
        )
        sealed += seal.event_count
        if seal.event_count < integrity.SEAL_BATCH or time.monotonic() >= until:
            break
    return sealed


@shared_task(acks_late=True, ignore_result=True)
def verify_next_slice_of_the_ledger() -> int:
    """Beat runs this every LEDGER_VERIFY_INTERVAL_SECONDS: the running verification
    pass checks slices of LEDGER_VERIFY_SLICE invocations and the seals that follow
    for LEDGER_VERIFY_SECONDS, logging each break it finds
    (`ledger.integrity.verify_slices_for`); returns how many slices it checked."""
    return verify_slices_for(
        seconds=settings.LEDGER_VERIFY_SECONDS, invocations=settings.LEDGER_VERIFY_SLICE
    )


@shared_task(acks_late=True, ignore_result=True)
def watch_declared_rate_limits() -> int:
    """Beat runs this every LEDGER_RATE_WATCH_INTERVAL_SECONDS: the admissions sealed
    since the last run, judged against their capabilities' declared rate limits
    (`ledger.rate_limits`), a transaction per BATCH sealed events until it has caught
    up or for LEDGER_CATCH_UP_SECONDS; returns how many invocations it flagged."""
    return _until_caught_up(rate_limits.watch_rate_limits)


@shared_task(acks_late=True, ignore_result=True)
def watch_shared_references() -> int:
    """Beat runs this every LEDGER_REFERENCE_WATCH_INTERVAL_SECONDS: the earlier
    invocations naming the shared references of the events sealed since the last run
    are flagged (`ledger.shared_references`), a transaction per BATCH sealed events
    until it has caught up or for LEDGER_CATCH_UP_SECONDS; returns how many
    invocations it flagged."""
    return _until_caught_up(shared_references.watch_shared_references)


class _WatchRun(Protocol):
    @property
    def flagged(self) -> list[str]: ...
    @property
    def caught_up(self) -> bool: ...


def _until_caught_up(watch: Callable[[], _WatchRun]) -> int:
    """Run a watch until it has read the newest seal, or for LEDGER_CATCH_UP_SECONDS,
    each run in its own transaction; how many invocations it flagged."""
    flagged = 0
    until = time.monotonic() + settings.LEDGER_CATCH_UP_SECONDS
    while True:
        watched = watch()
        flagged += len(watched.flagged)
        if watched.caught_up or time.monotonic() >= until:
            return flagged


@shared_task(acks_late=True, ignore_result=True)
def create_event_partitions() -> list[str]:
    """Beat runs this every LEDGER_PARTITION_INTERVAL_SECONDS: the event table's month
    partitions through partitions.MONTHS_AHEAD months ahead (`ledger.partitions`).
    Missing one for a while costs nothing but a warning; each run tries again."""
    made = partitions.create_event_partitions()
    for name in made:
        log.info("event partition made partition=%s", name)
    return made


@shared_task(acks_late=True, ignore_result=True)
def anchor_hashes() -> bool:
    """Beat runs this every LEDGER_ANCHOR_INTERVAL_SECONDS: the newest seal's hash and
    the action log's go to LEDGER_ANCHOR_URL, when one is set and they are new
    (`ledger.anchors`). A store that does not take them is logged, and the next run
    sends the newest then. Whether an anchor was recorded."""
    if not settings.LEDGER_ANCHOR_URL:
        return False
    try:
        anchor = anchors.anchor_newest()
    except anchors.AnchorRefused as exc:
        log.warning("anchor not taken url=%s: %s", anchors.where(settings.LEDGER_ANCHOR_URL), exc)
        return False
    if anchor is not None:
        log.info(
            "anchored seal=%s action=%s status=%d",
            anchor.seal_hash or "-",
            anchor.action_hash or "-",
            anchor.status,
        )
    return anchor is not None
