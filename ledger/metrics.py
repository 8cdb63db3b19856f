"""Prometheus metrics at `/metrics`: what an operator alerts on, read from the database.

Every figure is read at scrape time from PostgreSQL, through partial or time indexes,
so a scrape costs the same however large the ledger grows and answers the same from
whichever web process takes it: nothing is counted in process memory, which gunicorn's
several workers would each hold a different part of.

- `ledger_invocations_flagged{status}`: invocations that need reconciliation, by
  status, and `ledger_invocations_flagged_oldest_seconds`, how long the oldest of them
  has waited (the queue an operator works);
- `ledger_invocations_in_flight`: attempts awaiting an outcome;
- `ledger_invocations_overdue` and `ledger_invocations_overdue_oldest_seconds`: those
  past their deadline that the sweeper has not flagged yet, and by how long;
  `ledger_invocations_overdue_refused`: those of them whose rows were changed outside
  the ledger, which the sweep refuses to flag until an admin restores them;
- `ledger_probe_runs_last_hour{capability, finding}`: what probes found in the last hour
  (the runs that found no probe to run counted together, under `capability=""`);
- `ledger_probe_claims_reopened_last_hour{reason}`: probe claims reopened in the last
  hour because their worker was found gone (`probe_worker_lost`) or held its lease past
  its end (`lease_expired`): workers killed or hung while probing;
- `ledger_probes_concluding_nothing{capability, rule}`: 1 for each rule of a
  capability's http probe that concludes nothing as saved (a bare status, saved before
  a rule had to name the business system's answer): its invocations all go to people;
- `ledger_shared_references_last_hour{kind}`: evidence recorded in the last hour that
  names a business reference other invocations' evidence names already (flagged
  `reference_shared`), by event kind: one effect may be counted for two intents;
- `ledger_event_last_timestamp_seconds` and `ledger_seal_last_timestamp_seconds`: when
  the newest event was recorded and the newest seal made. (The age of the oldest
  unsealed event would say more directly whether the sealer keeps up, but finding it
  walks every event of the sealer's ten-minute lookback.)
- `ledger_verification_breaks{pass}`: the breaks (a chain, a replay, a row or a seal
  that does not verify) found by the last finished background verification pass and
  so far by the running one, and `ledger_verification_finished_timestamp_seconds`,
  when the last pass finished;
- `ledger_background_behind{work}`: 1 when the sweeper, the sealer, the verifier, the
  rate watch, the reference watch, the partition maker or, with LEDGER_ANCHOR_URL set,
  the anchoring has fallen behind by the
  rules of `BackgroundWork`, which the console's dashboard shows too. A row the sweep refuses
  does not count: it waits for an admin, not for beat;
- `ledger_rate_limit_breaches_unrecorded`: attempts the rate watch found admitted
  beyond a declared rate limit whose invocations' rows were changed outside the
  ledger, so that they wait for an admin before they can be flagged, and
  `ledger_shared_references_unrecorded`: the same for the reference watch's flags
  (ledger/shared_references.py).
- `ledger_rate_limit_window_admissions{capability}` and `ledger_rate_limit_window_count
  {capability}`: for each capability whose declared rate limit the ledger enforces, the
  admissions its window holds now and the most it may (ledger/rate_enforcement.py): at
  the count, its admissions are refused, which nothing else records.
- `ledger_event_partitions_ahead`: month partitions of the event table made for months
  after the current one (beat keeps three; alert below one), and
  `ledger_events_unpartitioned`: events that found no month partition and went to the
  default one (counted up to 1,000; alert above zero). See ledger/partitions.py.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Count, F, Func, IntegerField, Min, Q, Sum, TextField, Value
from django.db.models.fields.json import KT
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ledger import anchors, policy, rate_enforcement
from ledger.capabilities import probes_concluding_nothing
from ledger.integrity import newest_passes
from ledger.models import (
    NAMES_A_SHARED_REFERENCE,
    REOPENED_CLAIM_KINDS,
    Event,
    Invocation,
    RateWatch,
    ReferenceWatch,
    Seal,
    VerificationPass,
)
from ledger.partitions import UNPARTITIONED_COUNTED, PartitionState, partition_state
from ledger.services import rows_disagreeing, with_heads

RECENT = dt.timedelta(hours=1)
# Behind means that beat has missed this many sweeps or seals in a row: a minute at
# the default sweep interval of 5 s, ten minutes at the default seal interval of 60 s.
MISSED_SWEEPS = 12
MISSED_SEALS = 10
MISSED_VERIFICATIONS = 10
MISSED_RATE_WATCHES = 10
MISSED_REFERENCE_WATCHES = 10
# The overdue rows read, oldest first, to find the oldest that the sweep can flag: rows
# it refuses (changed outside the ledger, waiting for an admin) are rare.
OVERDUE_READ = 20


def sweeper_slack() -> dt.timedelta:
    return dt.timedelta(seconds=MISSED_SWEEPS * settings.LEDGER_SWEEP_INTERVAL_SECONDS)


def sealer_slack() -> dt.timedelta:
    return dt.timedelta(seconds=MISSED_SEALS * settings.LEDGER_SEAL_INTERVAL_SECONDS)


def verifier_slack() -> dt.timedelta:
    return dt.timedelta(seconds=MISSED_VERIFICATIONS * settings.LEDGER_VERIFY_INTERVAL_SECONDS)


def rate_watch_slack() -> dt.timedelta:
    return dt.timedelta(seconds=MISSED_RATE_WATCHES * settings.LEDGER_RATE_WATCH_INTERVAL_SECONDS)


def reference_watch_slack() -> dt.timedelta:
    return dt.timedelta(
        seconds=MISSED_REFERENCE_WATCHES * settings.LEDGER_REFERENCE_WATCH_INTERVAL_SECONDS
    )


def _seconds_since(then: dt.datetime | None, now: dt.datetime) -> float:
    return max((now - then).total_seconds(), 0.0) if then else 0.0


@dataclass(frozen=True)
class BackgroundWork:
    """Whether beat's sweeper and sealer keep up, as the ledger's rows show it."""

    now: dt.datetime
    overdue: int
    oldest_overdue_deadline: dt.datetime | None
    # Of the OVERDUE_READ oldest overdue: the ids of those the sweep refuses, and the
    # deadline of the oldest it can flag.
    refused: tuple[str, ...]
    oldest_flaggable_deadline: dt.datetime | None
    newest_event_at: dt.datetime | None
    newest_seal_at: dt.datetime | None
    oldest_unsealed_candidate_at: dt.datetime | None  # the first event, while no seal exists
    # The background verification passes: the one running, and the last one finished.
    running_pass: VerificationPass | None
    finished_pass: VerificationPass | None
    # The rate watch: the furthest-behind cursor of a declared limit's watch (None: no
    # capability declares one), the newest seal it should have read past by now, and
    # the breaches waiting for an admin.
    rate_watch_through: int | None
    sealed_a_while_ago: int | None
    rate_breaches_unrecorded: int
    # The reference watch: how far it has read (0 before its first run), the newest
    # seal it should have read past by now (None when it has read the newest seal),
    # and the invocations waiting for an admin before they can be flagged.
    reference_watch_through: int
    sealed_before_reference_slack: int | None
    reference_flags_unrecorded: int
    # The event table's month partitions (ledger.partitions).
    partitions: PartitionState
    # Whether a seal or an action recorded ten anchor intervals ago is not anchored yet;
    # None when no LEDGER_ANCHOR_URL is set (ledger.anchors).
    anchor_behind: bool | None = None

    @property
    def for_the_sweep(self) -> int:
        """The overdue attempts that the sweep can flag."""
        return self.overdue - len(self.refused)

    @property
    def sweeper_behind(self) -> bool:
        deadline = self.oldest_flaggable_deadline
        return deadline is not None and self.now - deadline > sweeper_slack()

    @property
    def sealer_behind(self) -> bool:
        if self.newest_event_at is None:
            return False
        if self.newest_seal_at is None:
            first = self.oldest_unsealed_candidate_at
            return first is not None and self.now - first > sealer_slack()
        return self.newest_event_at - self.newest_seal_at > sealer_slack()

    @property
    def verifier_behind(self) -> bool:
        """No slice for ten intervals. (Before the first one, beat's other work shows
        whether it runs.)"""
        newest = self.running_pass or self.finished_pass
        return newest is not None and self.now - newest.checked_at > verifier_slack()

    @property
    def rate_watch_behind(self) -> bool:
        """A watch has not read past a seal made ten watch intervals ago."""
        through, sealed = self.rate_watch_through, self.sealed_a_while_ago
        return through is not None and sealed is not None and through < sealed

    @property
    def reference_watch_behind(self) -> bool:
        """The watch has not read past a seal made ten watch intervals ago."""
        sealed = self.sealed_before_reference_slack
        return sealed is not None and self.reference_watch_through < sealed

    @property
    def partitions_behind(self) -> bool:
        """No partition made for next month (beat makes three ahead), or events that
        found none."""
        return self.partitions.months_ahead < 1 or self.partitions.unpartitioned > 0


# The finding of a probe_run event that ran no probe: its capability has none, so the
# invocation went to a person.
NO_PROBE = "none"


def probe_run_counts(since: dt.datetime) -> list[tuple[str, str, int]]:
    """The probe_run events since a time, counted by capability and finding."""
    counts = (
        Event.objects.filter(kind="probe_run", created_at__gte=since)
        .annotate(
            capability=F("invocation__capability_scope"),
            finding=Coalesce(KT("data__finding"), Value(NO_PROBE), output_field=TextField()),
        )
        .values("capability", "finding")
        .annotate(n=Count("id"))
        .values_list("capability", "finding", "n")
    )
    return list(counts)


def reopened_claim_counts(since: dt.datetime) -> dict[str, int]:
    """The probe claims reopened since a time, by event kind (every kind counted)."""
    counts = (
        Event.objects.filter(kind__in=REOPENED_CLAIM_KINDS, created_at__gte=since)
        .values("kind")
        .annotate(n=Count("id"))
        .values_list("kind", "n")
    )
    return {kind: 0 for kind in REOPENED_CLAIM_KINDS} | dict(counts)


@dataclass
class ProbeRuns:
    """A capability's probe_run events: the probes run, those that found nothing
    conclusive (tried again later), and apart, since no probe failed there, the
    invocations handed to a person because the capability has no probe."""

    capability: str
    runs: int = 0
    inconclusive: int = 0
    no_probe: int = 0


def probe_runs_per_capability(counts: Iterable[tuple[str, str, int]]) -> list[ProbeRuns]:
    """`probe_run_counts` by capability, the most probed first."""
    per_capability: dict[str, ProbeRuns] = {}
    for capability, finding, n in counts:
        runs = per_capability.setdefault(capability, ProbeRuns(capability))
        if finding == NO_PROBE:
            runs.no_probe += n
            continue
        runs.runs += n
        if finding == "inconclusive":  # reconciliation.probes.Finding.INCONCLUSIVE
            runs.inconclusive += n
    return sorted(per_capability.values(), key=lambda r: (-r.runs, -r.no_probe, r.capability))


def background_work(now: dt.datetime | None = None) -> BackgroundWork:
    now = now or timezone.now()
    overdue = Invocation.objects.overdue(now)
    counted = overdue.aggregate(n=Count("id"), oldest=Min("deadline_at"))
    # Read apart from the count, and only when there is one: a window counting beside
    # them would hold every overdue row, whole, to count them.
    oldest = (
        list(with_heads(overdue).order_by("deadline_at")[:OVERDUE_READ]) if counted["n"] else []
    )
    refused = rows_disagreeing(oldest)
    flaggable = [row.deadline_at for row in oldest if row.invocation_id not in refused]
    if not flaggable and len(refused) == OVERDUE_READ:
        # Every row read is refused: the oldest the sweep can flag is younger than the
        # last of them, and is taken as that old, which reports behind rather than not.
        flaggable = [oldest[-1].deadline_at]
    newest_seal = (
        Seal.objects.order_by("-last_sequence").values_list("created_at", "last_sequence").first()
    )
    newest_event = Event.objects.order_by("-created_at").values_list("created_at").first()
    first_event = None
    if newest_seal is None and newest_event is not None:
        first_event = Event.objects.order_by("created_at").values_list("created_at").first()
    running, finished = newest_passes()
    watches = RateWatch.objects.aggregate(
        through=Min("through_sequence", filter=Q(watching=True)),
        unrecorded=Sum(
            Func("unrecorded", function="jsonb_array_length", output_field=IntegerField())
        ),
    )
    sealed_a_while_ago = None
    if watches["through"] is not None:
        sealed_a_while_ago = _last_sealed_before(now - rate_watch_slack())
    reference_watch = (
        ReferenceWatch.objects.annotate(
            waiting=Func("unrecorded", function="jsonb_array_length", output_field=IntegerField())
        )
        .values_list("through_sequence", "waiting")
        .first()
    ) or (0, 0)
    sealed_before_reference_slack = None
    if newest_seal is not None and newest_seal[1] > reference_watch[0]:
        # Only while a seal is unread: a watch that has read the newest costs nothing more.
        sealed_before_reference_slack = _last_sealed_before(now - reference_watch_slack())
    return BackgroundWork(
        now=now,
        overdue=counted["n"],
        oldest_overdue_deadline=counted["oldest"],
        refused=tuple(refused),
        oldest_flaggable_deadline=flaggable[0] if flaggable else None,
        newest_event_at=newest_event[0] if newest_event else None,
        newest_seal_at=newest_seal[0] if newest_seal else None,
        oldest_unsealed_candidate_at=first_event[0] if first_event else None,
        running_pass=running,
        finished_pass=finished,
        rate_watch_through=watches["through"],
        sealed_a_while_ago=sealed_a_while_ago,
        rate_breaches_unrecorded=watches["unrecorded"] or 0,
        reference_watch_through=reference_watch[0],
        sealed_before_reference_slack=sealed_before_reference_slack,
        reference_flags_unrecorded=reference_watch[1],
        partitions=partition_state(now),
        anchor_behind=anchors.behind(now) if settings.LEDGER_ANCHOR_URL else None,
    )


def _last_sealed_before(at: dt.datetime) -> int | None:
    """The last sequence number of the newest seal made by `at`."""
    return (
        Seal.objects.filter(created_at__lte=at)
        .order_by("-last_sequence")
        .values_list("last_sequence", flat=True)
        .first()
    )


class LedgerCollector(Collector):
    """Reads the figures once per scrape: fourteen statements, each on an index or the
    catalog but one, which reads the capabilities' probes (as many as the registry
    holds, however much is recorded); one more before the first seal, one more while
    attempts are overdue (the oldest of them, with their events, to tell those the
    sweep refuses), one more while a capability declares a rate limit, one more
    while the reference watch has not read the newest seal, and three more with
    LEDGER_ANCHOR_URL set (the newest anchor, and the seal and the action it should
    have sent by now)."""

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

        oldest = Invocation.objects.flagged().aggregate(at=Min("flagged_at"))["at"]
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
        work = background_work(now)
        yield GaugeMetricFamily(
            "ledger_invocations_overdue",
            "In-flight invocations past their deadline that the sweeper has not flagged.",
            value=work.overdue,
        )
        yield GaugeMetricFamily(
            "ledger_invocations_overdue_oldest_seconds",
            "How long the oldest of them has been past its deadline (0 if none).",
            value=_seconds_since(work.oldest_overdue_deadline, now),
        )
        yield GaugeMetricFamily(
            "ledger_invocations_overdue_refused",
            f"Of the {OVERDUE_READ} oldest of them, those whose rows were changed outside the "
            "ledger: the sweep refuses them until an admin restores them from their events.",
            value=len(work.refused),
        )

        yield _probe_runs(probe_run_counts(now - RECENT))
        recent = Event.objects.filter(created_at__gte=now - RECENT)
        shared = (
            recent.filter(NAMES_A_SHARED_REFERENCE)
            .values("kind")
            .annotate(n=Count("id"))
            .values_list("kind", "n")
        )
        yield _counted(
            "ledger_shared_references_last_hour",
            "Evidence recorded in the last hour naming a business reference that other "
            "invocations' evidence names already, by event kind.",
            "kind",
            shared,
        )

        reopened = reopened_claim_counts(now - RECENT)
        claims = GaugeMetricFamily(
            "ledger_probe_claims_reopened_last_hour",
            "Probe claims reopened in the last hour and their probes sent again, by reason: "
            "the claiming worker's database session was gone (probe_worker_lost), or the "
            "worker held the claim past its lease (lease_expired), as a hung one does.",
            labels=["reason"],
        )
        for kind in REOPENED_CLAIM_KINDS:
            claims.add_metric([kind], reopened[kind])
        yield claims

        concluding_nothing = GaugeMetricFamily(
            "ledger_probes_concluding_nothing",
            "Capabilities whose http probe has a rule that concludes nothing as saved (a "
            "status alone, saved before a rule had to name the business system's answer), "
            "by rule: a person decides each of their invocations until an admin mends it.",
            labels=["capability", "rule"],
        )
        for scope, rules in probes_concluding_nothing():
            for rule in rules:
                concluding_nothing.add_metric([scope, rule], 1)
        yield concluding_nothing

        behind = GaugeMetricFamily(
            "ledger_background_behind",
            "1 when beat's sweeper (an attempt overdue for 12 sweep intervals), sealer "
            "(events newer than the newest seal by 10 seal intervals), verifier (no slice "
            "verified for 10 intervals), rate or reference watch (a seal unread for 10 "
            "intervals), partition maker (none made for next month, or events in the "
            "default partition) or anchoring (a seal or an action not sent to "
            "LEDGER_ANCHOR_URL for 10 intervals) is not keeping up.",
            labels=["work"],
        )
        behind.add_metric(["sweeper"], int(work.sweeper_behind))
        behind.add_metric(["sealer"], int(work.sealer_behind))
        behind.add_metric(["verifier"], int(work.verifier_behind))
        behind.add_metric(["rate_watch"], int(work.rate_watch_behind))
        behind.add_metric(["reference_watch"], int(work.reference_watch_behind))
        behind.add_metric(["partitions"], int(work.partitions_behind))
        if work.anchor_behind is not None:
            behind.add_metric(["anchor"], int(work.anchor_behind))
        yield behind
        yield GaugeMetricFamily(
            "ledger_rate_limit_breaches_unrecorded",
            "Attempts admitted beyond a declared rate limit, not yet flagged: their "
            "invocations' rows were changed outside the ledger and wait for an admin.",
            value=work.rate_breaches_unrecorded,
        )
        yield GaugeMetricFamily(
            "ledger_shared_references_unrecorded",
            "Invocations naming a business reference a later invocation's evidence names "
            "too, not yet flagged: their rows were changed outside the ledger and wait for "
            "an admin.",
            value=work.reference_flags_unrecorded,
        )
        yield from _enforced_rate_limits(rate_enforcement.windows_now())
        verification = GaugeMetricFamily(
            "ledger_verification_breaks",
            "Breaks found by background verification: chains, replays, rows or seals that "
            "do not verify, by the last finished pass and so far by the running one.",
            labels=["pass"],
        )
        for name, verified in (("finished", work.finished_pass), ("running", work.running_pass)):
            verification.add_metric([name], verified.break_count if verified else 0)
        yield verification
        finished_at = work.finished_pass.finished_at if work.finished_pass else None
        yield GaugeMetricFamily(
            "ledger_verification_finished_timestamp_seconds",
            "When the last background verification pass over the whole ledger finished, "
            "in Unix time (0 if none yet).",
            value=finished_at.timestamp() if finished_at else 0.0,
        )
        yield GaugeMetricFamily(
            "ledger_seal_last_timestamp_seconds",
            "When the newest seal was made, in Unix time (0 if none yet).",
            value=work.newest_seal_at.timestamp() if work.newest_seal_at else 0.0,
        )
        partitioned = work.partitions
        yield GaugeMetricFamily(
            "ledger_event_partitions_ahead",
            "Month partitions of the event table made for months after the current one (UTC).",
            value=partitioned.months_ahead,
        )
        yield GaugeMetricFamily(
            "ledger_events_unpartitioned",
            "Events that found no month partition and are in the default one (counted up "
            f"to {UNPARTITIONED_COUNTED}): beat has not made partitions for a while.",
            value=partitioned.unpartitioned,
        )
        yield GaugeMetricFamily(
            "ledger_event_last_timestamp_seconds",
            "When the newest event was recorded, in Unix time (0 if none yet).",
            value=work.newest_event_at.timestamp() if work.newest_event_at else 0.0,
        )


def _counted(
    name: str, documentation: str, label: str, counts: Iterable[tuple[str, int]]
) -> GaugeMetricFamily:
    """A gauge with one sample per label value counted (none when nothing was)."""
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for value, n in sorted(counts):
        family.add_metric([value], n)
    return family


def _enforced_rate_limits(windows: Iterable[rate_enforcement.Window]) -> Iterator[Metric]:
    admitted = GaugeMetricFamily(
        "ledger_rate_limit_window_admissions",
        "Attempts admitted within the current window of each capability whose declared "
        "rate limit the ledger enforces: at its count, runtimes' admissions are refused "
        "(429 rate_limited) until one leaves the window.",
        labels=["capability"],
    )
    count = GaugeMetricFamily(
        "ledger_rate_limit_window_count",
        "The declared count of each enforced rate limit: the admissions its window holds.",
        labels=["capability"],
    )
    for window in windows:
        admitted.add_metric([window.scope], window.admitted)
        count.add_metric([window.scope], window.limit.count)
    yield admitted
    yield count


def _probe_runs(counts: Iterable[tuple[str, str, int]]) -> GaugeMetricFamily:
    """By capability and finding. The runs that found no probe are counted together: a
    runtime names the scopes of undeclared capabilities, and would name the series."""
    family = GaugeMetricFamily(
        "ledger_probe_runs_last_hour",
        "Probe runs in the last hour, by capability and finding ('none': no probe to run, "
        "every capability's counted together).",
        labels=["capability", "finding"],
    )
    no_probe = 0
    for capability, finding, n in sorted(counts):
        if finding == NO_PROBE:
            no_probe += n
        else:
            family.add_metric([capability, finding], n)
    if no_probe:
        family.add_metric(["", NO_PROBE], no_probe)
    return family


def exposition(now: dt.datetime | None = None) -> bytes:
    """The metrics in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(now or timezone.now()))
    return generate_latest(registry)
