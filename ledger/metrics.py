"""Prometheus metrics at `/metrics`: what an operator alerts on, read from the database.

Every figure is read at scrape time from PostgreSQL, through partial or time indexes,
so a scrape costs the same however large the ledger grows and answers the same from
whichever web process takes it: nothing is counted in process memory, which gunicorn's
several workers would each hold a different part of.

- `ledger_invocations_flagged{status}`: invocations that need reconciliation, by
  status, and `ledger_invocations_flagged_oldest_seconds`, how long the oldest of them
  has waited (the queue an operator works);
- `ledger_invocations_in_flight` and `ledger_invocations_overdue`: attempts awaiting an
  outcome, and those past their deadline that the sweeper has not flagged yet (above
  zero for long, the sweeper or beat is down);
- `ledger_probe_runs_last_hour{finding}`: what probes found in the last hour;
- `ledger_event_last_timestamp_seconds` and `ledger_seal_last_timestamp_seconds`: when
  the newest event was recorded and the newest seal made. Beat seals whatever is new
  every `LEDGER_SEAL_INTERVAL_SECONDS`, so an event newer than the newest seal by many
  intervals means the sealer is down. (The age of the oldest unsealed event would say
  it directly, but finding it walks every event of the sealer's ten-minute lookback.)
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

from django.db.models import Count, Max, Min, TextField, Value
from django.db.models.fields.json import KT
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ledger import policy
from ledger.models import Event, Invocation, Seal

PROBE_WINDOW = dt.timedelta(hours=1)


def _seconds_since(then: dt.datetime | None, now: dt.datetime) -> float:
    return max((now - then).total_seconds(), 0.0) if then else 0.0


class LedgerCollector(Collector):
    """Reads the figures once per scrape: seven statements, each on an index."""

    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def collect(self) -> Iterator[Metric]:
        now = self.now
        flagged = GaugeMetricFamily(
            "ledger_invocations_flagged",
            "Invocations that need reconciliation, by status.",
            labels=["status"],
        )
        counts = dict(
            Invocation.objects.flagged()
            .values("status")
            .annotate(n=Count("id"))
            .values_list("status", "n")
        )
        for status in sorted(policy.NEEDS_RECONCILIATION):
            flagged.add_metric([status.value], counts.get(status.value, 0))
        yield flagged

        oldest = Invocation.objects.flagged().aggregate(at=Min("updated_at"))["at"]
        yield GaugeMetricFamily(
            "ledger_invocations_flagged_oldest_seconds",
            "How long the longest-waiting flagged invocation has waited (0 if none).",
            value=_seconds_since(oldest, now),
        )

        in_flight = Invocation.objects.filter(status=policy.Status.IN_FLIGHT)
        yield GaugeMetricFamily(
            "ledger_invocations_in_flight",
            "Invocations with an attempt admitted and no outcome yet.",
            value=in_flight.count(),
        )
        yield GaugeMetricFamily(
            "ledger_invocations_overdue",
            "In-flight invocations past their deadline that the sweeper has not flagged.",
            value=Invocation.objects.overdue(now).count(),
        )

        probes = GaugeMetricFamily(
            "ledger_probe_runs_last_hour",
            "Probe runs in the last hour, by finding ('none': no probe to run).",
            labels=["finding"],
        )
        findings = (
            Event.objects.filter(kind="probe_run", created_at__gte=now - PROBE_WINDOW)
            .annotate(
                finding=Coalesce(KT("data__finding"), Value("none"), output_field=TextField())
            )
            .values("finding")
            .annotate(n=Count("id"))
            .values_list("finding", "n")
        )
        for finding, n in sorted(findings):
            probes.add_metric([finding], n)
        yield probes

        newest_seal = Seal.objects.order_by("-last_sequence").values_list("created_at").first()
        yield GaugeMetricFamily(
            "ledger_seal_last_timestamp_seconds",
            "When the newest seal was made, in Unix time (0 if none yet).",
            value=newest_seal[0].timestamp() if newest_seal else 0.0,
        )
        newest_event = Event.objects.aggregate(at=Max("created_at"))["at"]
        yield GaugeMetricFamily(
            "ledger_event_last_timestamp_seconds",
            "When the newest event was recorded, in Unix time (0 if none yet).",
            value=newest_event.timestamp() if newest_event else 0.0,
        )


def exposition(now: dt.datetime | None = None) -> bytes:
    """The metrics in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(now or timezone.now()))
    return generate_latest(registry)
