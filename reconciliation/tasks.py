from __future__ import annotations

from celery import shared_task

from reconciliation import sweeper


@shared_task(acks_late=True, ignore_result=True)
def sweep_overdue_attempts() -> int:
    """Beat runs this every LEDGER_SWEEP_INTERVAL_SECONDS (reconciliation, issue 4)."""
    return sweeper.sweep()
