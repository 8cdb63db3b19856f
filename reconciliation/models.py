"""What reconciliation keeps beside the evidence: operational, never evidence."""

from __future__ import annotations

from django.db import models

from ledger.models import Invocation


class ProbeDispatch(models.Model):
    """The last probe job sent for a flagged invocation, so that each sweep does not
    send another while that one waits in the broker's queue: in a business system's
    outage, probes hang to their timeouts and every sweep would otherwise queue one
    more job for each invocation not yet probed.

    The job is spent once the invocation's row counts more events than when it was
    sent (a worker claimed it, or its lease ran out); one not started within a probe
    lease is taken as lost and sent again. Spent rows are deleted by the next sweep
    (`sweeper.forget_spent_probe_jobs`). Not evidence: no event records it, and
    losing it only sends a job twice, which does nothing twice.
    """

    invocation = models.OneToOneField(
        Invocation, on_delete=models.CASCADE, primary_key=True, related_name="probe_dispatch"
    )
    sent_at = models.DateTimeField()
    # The invocation's event_count when the job was sent.
    event_count = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"probe job sent {self.sent_at:%Y-%m-%d %H:%M:%S} at event {self.event_count}"
