from __future__ import annotations

from celery import shared_task

from ledger.integrity import seal_events


@shared_task(acks_late=True, ignore_result=True)
def seal_new_events() -> int:
    """Beat runs this every LEDGER_SEAL_INTERVAL_SECONDS; returns how many were sealed."""
    seal = seal_events()
    return seal.event_count if seal else 0
