from __future__ import annotations

import logging

from celery import shared_task
from django.conf import settings

from ledger.integrity import seal_events, verify_next_slice
from ledger.rate_limits import watch_rate_limits

log = logging.getLogger(__name__)


@shared_task(acks_late=True, ignore_result=True)
def seal_new_events() -> int:
    """Beat runs this every LEDGER_SEAL_INTERVAL_SECONDS; returns how many were sealed.

    Each seal's hash also goes to the log: kept by whatever collects the logs, outside
    the database, it anchors the seal chain (and evidence bundles, `verify_bundle
    --seal`) against someone who could rewrite the database, hashes and all.
    """
    seal = seal_events()
    if seal is None:
        return 0
    log.info(
        "sealed first_sequence=%d last_sequence=%d events=%d merkle_root=%s hash=%s",
        seal.first_sequence,
        seal.last_sequence,
        seal.event_count,
        seal.merkle_root,
        seal.hash,
    )
    return seal.event_count


@shared_task(acks_late=True, ignore_result=True)
def verify_next_slice_of_the_ledger() -> None:
    """Beat runs this every LEDGER_VERIFY_INTERVAL_SECONDS: the running verification
    pass checks the next LEDGER_VERIFY_SLICE invocations and the seals that follow,
    logging each break it finds (`ledger.integrity.verify_next_slice`)."""
    verify_next_slice(invocations=settings.LEDGER_VERIFY_SLICE)


@shared_task(acks_late=True, ignore_result=True)
def watch_declared_rate_limits() -> int:
    """Beat runs this every LEDGER_RATE_WATCH_INTERVAL_SECONDS: the admissions sealed
    since the last run, judged against their capabilities' declared rate limits
    (`ledger.rate_limits`); returns how many invocations it flagged."""
    return len(watch_rate_limits().flagged)
