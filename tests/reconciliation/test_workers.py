"""End to end with real Celery workers (and beat) on the real broker, a real
PostgreSQL and the stand-in payments service: the scenarios of DESIGN section 6."""

from __future__ import annotations

import datetime as dt
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
from django.db import connection
from django.db.models import Count, Q
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from ledger.models import Anchor, Capability, Event, Invocation, Seal, VerificationPass
from ledger.partitions import create_event_partitions, month_partition, partition_state
from ledger.services import flag_missing_evidence
from reconciliation import probes
from reconciliation.standin import StandInService
from reconciliation.tasks import reconcile_invocation, sweep_overdue_attempts
from tests.conftest import (
    LOG_RECORD,
    LOG_TIME,
    ROOT,
    AnchorStore,
    Api,
    person,
    registered,
    wait_for,
)
from tests.reconciliation.conftest import Workers, perform_refund, reported_lost, status_of
from tests.running import make_run

pytestmark = pytest.mark.django_db(transaction=True)

SETTLED = ("succeeded", "retry_allowed", "failed", "escalated")


@pytest.mark.embedded_broker
def test_a_refund_whose_outcome_was_lost_is_found_and_never_repeated(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers, tmp_path: Path
) -> None:
    workers.start()
    workers.beat(tmp_path)
    # 1. intent, admitted; 2. the tool creates the refund; 3. the outcome report is lost.
    assert api.intent(attempt_id="a1")[1]["status"] == "in_flight"
    refund = perform_refund(standin, "refund-SO-1").json()
    # 4. past the deadline the ledger says: unknown after dispatch, do not retry. The
    # probe may have settled it before the read below: what the flag said is its event's.
    wait_for(lambda: status_of("inv-1") != "in_flight")
    _, seen = api.get("/api/v1/invocations/inv-1")
    assert (seen["failure_class"], seen["retryable"]) == ("post_dispatch_evidence_failed", False)
    flag = Invocation.objects.get().events.get(kind="evidence_missing").data["state"]
    assert (flag["status"], flag["cause"]) == ("reconciliation_required", "evidence_missing")
    # 5. no second dispatch: a new attempt is refused while the outcome is unknown.
    if seen["status"] in ("reconciliation_required", "reconciling"):
        assert api.attempt("inv-1", "a2")[0] == 409
    # 6. reconciliation asks the payments service by idempotency key.
    wait_for(lambda: status_of("inv-1") in SETTLED)
    invocation = Invocation.objects.get()
    assert invocation.status == "succeeded"
    assert invocation.events.get(kind="probe_run").data["business_reference"] == refund["id"]
    # 7. the evidence is complete and there is still exactly one refund.
    assert standin.refunds.count() == 1
    assert api.attempt("inv-1", "a2")[1]["error"]["type"] == "attempt_refused"


def test_a_refund_that_never_happened_is_retried_once_under_the_same_key(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers, tmp_path: Path
) -> None:
    workers.start()
    workers.beat(tmp_path)
    api.intent(attempt_id="a1")  # the runtime crashed before its tool call
    wait_for(lambda: status_of("inv-1") == "retry_allowed")
    assert api.attempt("inv-1", "a2")[0] == 201
    perform_refund(standin, "refund-SO-1")
    assert api.outcome("inv-1", "a2", kind="succeeded")[1]["status"] == "succeeded"
    assert standin.refunds.count() == 1


def asks_the_standin_without_timeouts(invocation: Invocation) -> probes.ProbeResult:
    """A python probe that asks the stand-in (STANDIN_URL) with no timeout: bounding
    nothing itself, it is claimed for LEDGER_PROBE_LEASE_SECONDS alone."""
    httpx.get(
        f"{os.environ['STANDIN_URL']}/refunds",
        params={"idempotency_key": invocation.idempotency_key},
        timeout=None,  # noqa: S113 (the point: a probe that bounds nothing)
    )
    return probes.ProbeResult(probes.Finding.INCONCLUSIVE, detail="asked with no timeout")


def probing_refund_that_hangs(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers, lease_seconds: int
) -> subprocess.Popen[bytes]:
    """A refund made and its outcome lost; a worker whose claims last `lease_seconds`,
    in the middle of its probe, which hangs: the worker. Its probe sets no timeouts, so
    that its claim lasts no longer (an http probe's lasts as long as it may take); the
    capability's http probe is back for whoever probes next."""
    python_probe = f"{__name__}.{asks_the_standin_without_timeouts.__name__}"
    Capability.objects.filter(pk=refunds.pk).update(
        probe={"kind": "python", "callable": python_probe}
    )
    api.intent(attempt_id="a1")
    perform_refund(standin, "refund-SO-1")
    deadline = Invocation.objects.get().deadline_at
    assert deadline is not None and flag_missing_evidence(invocation_id="inv-1", now=deadline)
    standin.refunds.set_mode("slow")  # the probe will hang
    worker = workers.start(
        LEDGER_PROBE_LEASE_SECONDS=str(lease_seconds),
        LEDGER_PYTHON_PROBES=python_probe,
        STANDIN_URL=standin.url,
    )
    reconcile_invocation.delay("inv-1")
    lookups = standin.refunds.lookups_started
    wait_for(lambda: standin.refunds.lookups_started > lookups)  # the probe is in flight
    assert status_of("inv-1") == "reconciling"
    Capability.objects.filter(pk=refunds.pk).update(probe=standin.probe_config())
    return worker


@pytest.mark.embedded_broker
def test_a_worker_killed_mid_probe_is_replaced_and_the_invocation_settles_once(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers
) -> None:
    doomed = probing_refund_that_hangs(api, refunds, standin, workers, lease_seconds=2)
    workers.kill(doomed)
    standin.refunds.set_mode("normal")
    workers.start(LEDGER_PROBE_LEASE_SECONDS="2")
    lease = Invocation.objects.get().lease_expires_at
    assert lease is not None
    while timezone.now() <= lease:
        time.sleep(0.2)
    sweep_overdue_attempts.run()  # what beat does: expire the lease, re-queue
    wait_for(lambda: status_of("inv-1") in SETTLED)
    invocation = Invocation.objects.get()
    assert invocation.status == "succeeded"
    kinds = list(invocation.events.order_by("seq").values_list("kind", flat=True))
    assert kinds[3:] == [
        "reconciliation_claimed",
        "lease_expired",
        "reconciliation_claimed",
        "probe_run",
    ]


@pytest.mark.embedded_broker
def test_a_worker_killed_mid_probe_is_found_gone_without_waiting_for_its_lease(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers, tmp_path: Path
) -> None:
    """Its database session ended with it, and its probe lock with the session: beat's
    next sweep reopens the invocation, ten minutes before the lease would run out."""
    doomed = probing_refund_that_hangs(api, refunds, standin, workers, lease_seconds=600)
    workers.kill(doomed)
    standin.refunds.set_mode("normal")
    workers.start()
    workers.beat(tmp_path)
    wait_for(lambda: status_of("inv-1") in SETTLED)
    invocation = Invocation.objects.get()
    assert invocation.status == "succeeded"
    events = list(invocation.events.order_by("seq"))
    assert [event.kind for event in events[3:]] == [
        "reconciliation_claimed",
        "probe_worker_lost",
        "reconciliation_claimed",
        "probe_run",
    ]
    lost = events[4]
    assert lost.data["worker"] == events[3].data["worker"]
    assert lost.created_at < dt.datetime.fromisoformat(lost.data["lease_expires_at"])
    assert standin.refunds.count() == 1


def test_a_worker_started_by_hand_on_the_embedded_broker_runs_its_jobs_in_threads(
    api: Api, refunds: Capability, workers: Workers, tmp_path: Path
) -> None:
    """Not in prefork's processes, which take their jobs through one pipe behind one
    lock on a broker without an event loop (ledger/run.py)."""
    embedded = {"CELERY_BROKER_URL": "filesystem://localhost//", "LEDGER_DATA_DIR": str(tmp_path)}
    worker = workers.start(
        pool=None, CELERY_BROKER_URL=embedded["CELERY_BROKER_URL"], LEDGER_DATA_DIR=str(tmp_path)
    )
    api.intent(attempt_id="a1")
    Invocation.objects.update(deadline_at=timezone.now() - dt.timedelta(seconds=1))
    subprocess.run(
        [sys.executable, "-m", "celery", "-A", "ledger", "call",
         "reconciliation.tasks.sweep_overdue_attempts"],
        cwd=ROOT, env={**workers.env, **embedded}, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: status_of("inv-1") != "in_flight")
    assert Invocation.objects.get().failure_class == "post_dispatch_evidence_failed"
    assert psutil.Process(worker.pid).children() == []


def test_make_run_keeps_a_worker_for_the_sweep_while_every_probe_hangs(
    api: Api, refunds: Capability, standin: StandInService, tmp_path: Path
) -> None:
    """In a business system's outage each probe waits out its timeouts. Queued with
    them, beat's sweep waited behind every one; it has a queue and a worker of its own.
    The probes wait side by side, as many as the other worker has threads."""
    Capability.objects.filter(pk=refunds.pk).update(
        probe={**standin.probe_config(), "read_timeout": 60}
    )
    standin.refunds.set_mode("slow")
    for n in range(3):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"refund-SO-{n}", attempt_id="a1")
        deadline = Invocation.objects.get(invocation_id=f"inv-{n}").deadline_at
        assert deadline is not None and flag_missing_evidence(
            invocation_id=f"inv-{n}", now=deadline
        )
    with make_run(tmp_path, LEDGER_SWEEP_INTERVAL_SECONDS="1", PROBE_THREADS="2") as ledger:
        wait_for(ledger.ready, seconds=120)
        wait_for(lambda: standin.refunds.lookups_started == 2)  # both threads hang in probes

        def flagged_when_overdue(invocation_id: str) -> None:
            api.intent(invocation_id=invocation_id, idempotency_key=invocation_id, attempt_id="a1")
            Invocation.objects.filter(invocation_id=invocation_id).update(
                deadline_at=timezone.now() - dt.timedelta(seconds=1)
            )
            wait_for(lambda: status_of(invocation_id) != "in_flight")

        for n in range(3):
            flagged_when_overdue(f"late-{n}")
        assert standin.refunds.lookups_started == 2  # the third probe waits for a thread


@pytest.mark.embedded_broker
def test_two_workers_racing_for_200_invocations_settle_each_exactly_once(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers
) -> None:
    items = [
        {"type": "intent", "invocation_id": f"inv-{n}", "task_id": "t",
         "capability": "refund.create", "arguments": {"n": n},
         "idempotency_key": f"key-{n}", "attempt_id": "a1"}
        for n in range(200)
    ]  # fmt: skip
    assert api.post("/api/v1/evidence", items)[0] == 207
    for n in range(0, 200, 2):
        perform_refund(standin, f"key-{n}")
    later = timezone.now() + dt.timedelta(seconds=5)
    for n in range(200):
        assert flag_missing_evidence(invocation_id=f"inv-{n}", now=later)
    workers.start()
    workers.start()
    for _ in range(2):  # every job delivered twice
        for n in range(200):
            reconcile_invocation.delay(f"inv-{n}")
    wait_for(lambda: not Invocation.objects.exclude(status__in=SETTLED).exists(), seconds=120)
    rows = Invocation.objects.annotate(
        runs=Count("events", filter=Q(events__kind="probe_run"))
    ).values_list("invocation_id", "status", "runs")
    for invocation_id, status, runs in rows:
        n = int(invocation_id.removeprefix("inv-"))
        assert runs == 1, invocation_id
        assert status == ("succeeded" if n % 2 == 0 else "retry_allowed"), invocation_id
    assert standin.refunds.count() == 100


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_broker_outage_loses_no_invocation(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers, tmp_path: Path
) -> None:
    """Beat and the worker use a private Redis, which is stopped during the sweeps."""
    port = free_port()
    server = [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(tmp_path),
    ]  # fmt: skip
    broker = subprocess.Popen(server, stdout=subprocess.DEVNULL)
    try:
        private_broker = f"redis://127.0.0.1:{port}/0"

        def answers() -> bool:
            """The private Redis is up."""
            try:
                with redis.Redis(host="127.0.0.1", port=port) as client:
                    return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(answers, seconds=10)
        workers.start(CELERY_BROKER_URL=private_broker)
        workers.beat(tmp_path, CELERY_BROKER_URL=private_broker)
        broker.terminate()
        broker.wait(timeout=10)
        for n in range(5):
            api.intent(invocation_id=f"inv-{n}", idempotency_key=f"key-{n}", attempt_id="a1")
            if n % 2 == 0:
                perform_refund(standin, f"key-{n}")
        time.sleep(3)  # deadlines pass while nothing can be delivered
        assert Invocation.objects.filter(status="in_flight").count() == 5
        broker = subprocess.Popen(server, stdout=subprocess.DEVNULL)
        wait_for(lambda: Invocation.objects.filter(status__in=SETTLED).count() == 5, seconds=90)
    finally:
        broker.terminate()
        broker.wait(timeout=10)
    statuses = dict(Invocation.objects.values_list("invocation_id", "status"))
    assert statuses == {
        f"inv-{n}": "succeeded" if n % 2 == 0 else "retry_allowed" for n in range(5)
    }
    assert standin.refunds.count() == 3


def test_the_demo_runs_its_traffic_and_everything_settles(
    live_server: object, workers: Workers, tmp_path: Path, settings: object
) -> None:
    import io

    from django.core.management import call_command

    workers.start()
    workers.beat(tmp_path)
    out = io.StringIO()
    call_command("demo", url=str(live_server), rounds=1, timeout=60, stdout=out)
    report = out.getvalue()
    rows = {line.split("  ")[0]: line for line in report.splitlines() if line.startswith("demo-")}
    assert len(rows) == 4
    # Settled as, the cause, the runtime's retry, the refunds made under its key.
    assert (
        "outcome lost after refund   succeeded       reconciled_effect_present   -           1"
        in report
    )
    assert (
        "crash before refund         retry_allowed   reconciled_effect_absent    succeeded   1"
        in report
    )
    assert (
        "business refuses            failed          business_rejected           -           0"
        in report
    )
    assert (
        "succeeds                    succeeded       -                           -           1"
        in report
    )


def test_beat_flags_an_attempt_admitted_beyond_the_declared_rate(
    api: Api, workers: Workers, tmp_path: Path
) -> None:
    """Beat seals, then the watch reads what was sealed: the third refund admitted within
    the hour, against a declared two, is flagged with no call but the runtime's."""
    registered("refund.create", rate_limit={"count": 2, "window": "1h"})
    workers.start()
    workers.beat(tmp_path, LEDGER_SEAL_INTERVAL_SECONDS="1", LEDGER_RATE_WATCH_INTERVAL_SECONDS="1")
    for n in (1, 2, 3):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    wait_for(lambda: Event.objects.filter(kind="rate_limit_exceeded").exists())
    flagged = Invocation.objects.filter(flags__contains=["rate_limit_exceeded"])
    assert list(flagged.values_list("invocation_id", flat=True)) == ["inv-3"]


def test_beat_flags_the_earlier_invocation_naming_a_shared_reference(
    api: Api, refund: Capability, workers: Workers, tmp_path: Path
) -> None:
    """Two refunds named RF-1: the second is flagged as it is recorded, and the first
    once beat has sealed the second's outcome and the reference watch has read it."""
    workers.start()
    workers.beat(
        tmp_path, LEDGER_SEAL_INTERVAL_SECONDS="1", LEDGER_REFERENCE_WATCH_INTERVAL_SECONDS="1"
    )
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        api.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference="RF-1")
    wait_for(lambda: Event.objects.filter(kind="reference_shared").exists())
    flagged = Invocation.objects.filter(flags__contains=["reference_shared"])
    assert sorted(flagged.values_list("invocation_id", flat=True)) == ["inv-1", "inv-2"]
    (told,) = Event.objects.filter(kind="reference_shared")
    assert (told.invocation.invocation_id, told.actor) == ("inv-1", "ledger:reference_watch")


def test_beat_has_a_worker_make_the_event_partition_missing_ahead(
    workers: Workers, tmp_path: Path
) -> None:
    """The third month ahead, dropped here as the role that migrated could, is made
    again by the worker, through the function that runs with that role's rights."""
    third = month_partition(timezone.now(), months_later=3)
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE ledger_event DETACH PARTITION {third}")
            cursor.execute(f"DROP TABLE {third}")
        assert partition_state().months_ahead == 2
        workers.start()
        workers.beat(tmp_path, LEDGER_PARTITION_INTERVAL_SECONDS="1")
        wait_for(lambda: partition_state().months_ahead == 3)
    finally:
        create_event_partitions()  # for the tests after, whatever happened


def test_metrics_report_a_killed_beat_and_its_return(
    api: Api, refund: Capability, workers: Workers, tmp_path: Path, settings: Any
) -> None:
    """`ledger_background_behind{work="sweeper"}` is 1 while no beat sweeps, and 0 once
    one is back; the web side reads the same interval as beat (1 s: behind after 12 s)."""
    settings.LEDGER_SWEEP_INTERVAL_SECONDS = 1
    workers.start()
    beat = workers.beat(tmp_path)
    web = Client()

    def overdue_by(invocation_id: str, seconds: int) -> None:
        Invocation.objects.filter(invocation_id=invocation_id).update(
            deadline_at=timezone.now() - dt.timedelta(seconds=seconds)
        )

    def sweeper_behind() -> float:
        for family in text_string_to_metric_families(web.get("/metrics").content.decode()):
            for sample in family.samples:
                if sample.name == "ledger_background_behind" and sample.labels["work"] == "sweeper":
                    return sample.value
        raise AssertionError("no ledger_background_behind sample")

    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    overdue_by("inv-1", 20)
    wait_for(lambda: status_of("inv-1") == "escalated")  # swept, then no probe
    assert sweeper_behind() == 0

    workers.kill(beat)
    api.intent(invocation_id="inv-2", idempotency_key="k-2", attempt_id="a1")
    overdue_by("inv-2", 20)
    # Not a wait for something to happen: the window in which a live beat (sweeping
    # every second) would have flagged inv-2 three times over, and nothing may.
    time.sleep(3)
    assert status_of("inv-2") == "in_flight"
    assert sweeper_behind() == 1

    workers.beat(tmp_path)
    wait_for(lambda: status_of("inv-2") == "escalated")
    assert sweeper_behind() == 0


def test_worker_and_beat_log_what_they_did_in_the_web_format(
    api: Api, refund: Capability, workers: Workers, tmp_path: Path
) -> None:
    """Every process logs through settings.LOGGING, and a sweep that finds nothing
    says nothing: beat's sending, the worker's receipt and its success would be three
    lines a sweep, every few seconds, around the lines that say something."""
    worker_log, beat_log = tmp_path / "worker.log", tmp_path / "beat.log"
    workers.start(log=worker_log, LOG_LEVEL="INFO")
    workers.beat(tmp_path, log=beat_log, LOG_LEVEL="INFO")

    def falls_due(invocation_id: str, seconds: int) -> None:
        api.intent(invocation_id=invocation_id, idempotency_key=invocation_id, attempt_id="a1")
        Invocation.objects.filter(invocation_id=invocation_id).update(
            deadline_at=timezone.now() + dt.timedelta(seconds=seconds)
        )

    falls_due("inv-1", -20)
    wait_for(lambda: status_of("inv-1") == "escalated")  # swept, then no probe
    # inv-2 falls due 3 s from now: the sweeps until then, one a second, find nothing
    # and may log nothing.
    falls_due("inv-2", 3)
    wait_for(lambda: status_of("inv-2") == "escalated")
    workers.stop_all()

    def records(log: Path) -> list[str]:
        """The log's records: each starts a line with its time (a warning's text may
        run on over more lines), and nothing comes before the first."""
        before_first, *records = re.split(f"^(?={LOG_TIME} )", log.read_text(), flags=re.M)
        assert before_first == ""
        return records

    worker, beat = records(worker_log), records(beat_log)
    assert [record for record in worker + beat if not LOG_RECORD.match(record)] == []
    said = [record.split(" ", 4)[-1].strip() for record in worker]
    assert said.count("sweep flagged=1") == 2
    for n in (1, 2):
        assert said.count(f"probe invocation=inv-{n} finding=no_probe status=escalated") == 1
    assert not [record for record in worker if "received" in record or "succeeded in" in record]
    assert not [record for record in beat if "Sending due task" in record]


def test_beat_has_a_worker_verify_the_ledger_and_find_a_row_changed_outside_it(
    api: Api, refund: Capability, workers: Workers, tmp_path: Path
) -> None:
    api.intent(invocation_id="inv-1", idempotency_key="k-1")
    api.intent(invocation_id="inv-2", idempotency_key="k-2")
    Invocation.objects.filter(invocation_id="inv-2").update(status="failed")
    workers.start()
    workers.beat(tmp_path, LEDGER_VERIFY_INTERVAL_SECONDS="1")

    found = VerificationPass.objects.filter(finished_at__isnull=False, break_count__gt=0)
    wait_for(found.exists)
    verified = found.earliest("started_at")
    assert (verified.invocations, verified.events) == (2, 2)
    assert verified.breaks == [
        {
            "break": "projection broken at invocation inv-2 status: expected 'recorded', "
            "found 'failed'",
            "invocation_id": "inv-2",
        }
    ]


@pytest.mark.embedded_broker
def test_after_an_outage_an_operator_reruns_every_escalated_probe_and_each_settles_once(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers, settings: Any
) -> None:
    """The payments service answered 5xx while three outcomes were lost: each probe
    could not tell, and each invocation went to people. Once it is back, one request
    re-runs them all, on a real worker."""
    settings.LEDGER_PROBE_MAX_TRIES = 1  # this process's probes escalate at once
    standin.refunds.set_mode("5xx")
    for n in range(3):
        reported_lost(api, f"inv-{n}")
        reconcile_invocation.run(f"inv-{n}")
    perform_refund(standin, "k-inv-0")
    perform_refund(standin, "k-inv-1")
    assert {status_of(f"inv-{n}") for n in range(3)} == {"escalated"}
    assert Invocation.objects.filter(cause="probe_inconclusive").count() == 3
    standin.refunds.set_mode("normal")
    workers.start()

    answer = person("olga", "operator").post("/queue/probes", {"capability": "refund.create"})

    assert answer.status_code == 302
    wait_for(lambda: all(status_of(f"inv-{n}") != "escalated" for n in range(3)))
    wait_for(lambda: not Invocation.objects.filter(status="reconciling").exists())
    assert [status_of(f"inv-{n}") for n in range(3)] == ["succeeded", "succeeded", "retry_allowed"]
    for invocation in Invocation.objects.all():
        events = list(invocation.events.order_by("seq").values_list("kind", "actor"))
        # Asked once, by olga; claimed and probed once, by the worker.
        assert events[-3:][0] == ("probe_requested", "user:olga"), events
        assert [kind for kind, _ in events[-2:]] == ["reconciliation_claimed", "probe_run"]
        assert [kind for kind, _ in events].count("probe_requested") == 1
    assert standin.refunds.count() == 2


def test_beat_sends_each_new_seal_to_the_store(
    api: Api, anchor_store: AnchorStore, workers: Workers, tmp_path: Path
) -> None:
    """Real beat and worker: a seal made of the API's events reaches the anchor_store."""
    workers.start(LEDGER_ANCHOR_URL=anchor_store.url, LEDGER_ANCHOR_INTERVAL_SECONDS="1")
    workers.beat(
        tmp_path,
        LEDGER_SEAL_INTERVAL_SECONDS="1",
        LEDGER_ANCHOR_URL=anchor_store.url,
        LEDGER_ANCHOR_INTERVAL_SECONDS="1",
    )
    api.intent(invocation_id="inv-1", idempotency_key="k-1")
    wait_for(lambda: Seal.objects.exists() and Anchor.objects.exists())
    newest = Seal.objects.order_by("-last_sequence").first()
    assert newest is not None
    wait_for(lambda: any(body["seal"]["hash"] == newest.hash for _, body in anchor_store.received))


def test_python_probes_that_never_answer_leave_the_workers_threads_to_other_probes(
    api: Api, refunds: Capability, standin: StandInService, workers: Workers
) -> None:
    """A real worker with two threads: two invocations whose python probe hangs (its
    business system's client has no timeout) are inconclusive at the probe's 1 s, and
    the refund probed over http after them is found. Before, each hung probe held a
    thread until it returned, and nothing else was probed on that worker."""
    hangs = "tests.reconciliation.test_reconcile.hangs"
    registered("hr.employee.update")
    Capability.objects.filter(scope="hr.employee.update").update(
        probe={"kind": "python", "callable": hangs, "timeout": 1}
    )
    for n in (1, 2):
        api.intent(
            invocation_id=f"hr-{n}", capability="hr.employee.update", idempotency_key=f"hr-{n}",
            attempt_id="a1",
        )  # fmt: skip
        api.outcome(f"hr-{n}", "a1", kind="post_dispatch_evidence_failed")
    api.intent(invocation_id="inv-1", idempotency_key="refund-SO-1", attempt_id="a1")
    perform_refund(standin, "refund-SO-1")
    api.outcome("inv-1", "a1", kind="post_dispatch_evidence_failed")
    workers.start(pool="threads", concurrency=2, LEDGER_PYTHON_PROBES=hangs)
    for invocation_id in ("hr-1", "hr-2", "inv-1"):
        reconcile_invocation.delay(invocation_id)
    wait_for(lambda: status_of("inv-1") == "succeeded", seconds=30)
    hung = Event.objects.filter(kind="probe_run", invocation__invocation_id__startswith="hr-")
    assert (
        sorted(hung.values_list("data__detail", flat=True))
        == ["no answer within 1 s; the probe runs on, unwatched"] * 2
    )
