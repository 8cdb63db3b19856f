"""The sweep: overdue attempts become post_dispatch_evidence_failed, cheaply, and the
real broker delivers the beat's task to a real worker."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.cache.backends import db as db_cache
from django.db import connection
from django.utils import timezone

import reconciliation.services
from ledger import services, store
from ledger.models import Capability, Event, Invocation
from reconciliation import sweeper
from reconciliation.models import ProbeDispatch
from reconciliation.probes import Finding, ProbeResult
from reconciliation.tasks import reconcile_invocation, sweep_overdue_attempts
from tests.conftest import Api, intent_body, process_env, wait_for
from tests.reconciliation.conftest import BrokerQueue, Workers, status_of

ROOT = Path(__file__).resolve().parents[2]


def statuses() -> dict[str, str]:
    return dict(Invocation.objects.values_list("invocation_id", "status"))


def past_deadline() -> dt.datetime:
    deadline = Invocation.objects.get(invocation_id="inv-1").deadline_at
    assert deadline is not None
    return deadline + dt.timedelta(seconds=1)


def test_the_sweep_flags_overdue_attempts_and_only_those(
    api: Api, refund: Capability, lookup: Capability
) -> None:
    api.intent(attempt_id="a1")
    api.intent(invocation_id="inv-2", idempotency_key="k2", attempt_id="a1")
    api.outcome("inv-2", "a1", kind="succeeded")
    api.intent(
        invocation_id="inv-3", idempotency_key="k3", capability="order.read", attempt_id="a1"
    )
    now = past_deadline()
    assert sweeper.sweep(now=now) == 2
    assert statuses() == {
        "inv-1": "reconciliation_required",
        "inv-2": "succeeded",
        "inv-3": "retry_allowed",  # readonly: lost evidence is safe to retry
    }
    assert Invocation.objects.get(invocation_id="inv-1").cause == "evidence_missing"
    assert sweeper.sweep(now=now) == 0  # nothing is flagged twice


def test_a_sweep_stops_at_its_time_and_the_next_flags_the_rest(
    api: Api, refund: Capability, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker sends RabbitMQ no heartbeat while it runs a task: one sweep of 94,726
    overdue attempts ran 3.5 minutes, and RabbitMQ closed its connection after 60 s.
    A sweep stops after its round that ends past LEDGER_CATCH_UP_SECONDS (here at once,
    a round being one invocation); the next goes on."""
    for n in (1, 2, 3):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    settings.LEDGER_CATCH_UP_SECONDS = 0
    now = past_deadline() + dt.timedelta(seconds=1)
    assert [sweeper.sweep(now=now, batch=1) for _ in range(4)] == [1, 1, 1, 0]
    assert set(statuses().values()) == {"reconciliation_required"}
    assert "sweep flagged=1, stopped for the next sweep" in caplog.text


def test_many_attempts_falling_due_at_once_are_flagged_a_hundred_per_write(
    api: Api, refund: Capability
) -> None:
    items = [
        {"type": "intent", **intent_body(invocation_id=f"inv-{n}", idempotency_key=f"k{n}"),
         "attempt_id": "a1"}
        for n in range(1, 251)
    ]  # fmt: skip
    assert api.post("/api/v1/evidence", items)[0] == 207
    writes: list[str] = []

    def count_writes(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if "ledger_assert_written" in sql:
            writes.append(sql)
        return execute(sql, *args)

    with connection.execute_wrapper(count_writes):
        assert sweeper.sweep(now=past_deadline()) == 250

    assert len(writes) == 3  # 100 + 100 + 50
    assert set(statuses().values()) == {"reconciliation_required"}
    assert Event.objects.filter(kind="evidence_missing").count() == 250


@pytest.fixture
def three_in_flight(api: Api, refund: Capability) -> None:
    """inv-1, inv-2 and inv-3, each with its attempt a1 in flight."""
    for n in (1, 2, 3):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k{n}", attempt_id="a1")


def test_an_outcome_arriving_during_the_sweep_wins_and_the_rest_are_flagged(
    api: Api, three_in_flight: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = store.write
    arrived: list[int] = []

    def outcome_arrives_first(writes: store.Writes) -> None:
        # Between the sweep's read and its write, the runtime reports inv-2's outcome
        # (whose own write comes through here too, and goes straight on).
        if not arrived:
            arrived.append(0)
            arrived[0] = api.outcome("inv-2", "a1", kind="succeeded")[0]
        write(writes)

    monkeypatch.setattr(store, "write", outcome_arrives_first)

    assert sweeper.sweep(now=past_deadline()) == 2

    assert arrived == [201]
    assert statuses() == {
        "inv-1": "reconciliation_required",
        "inv-2": "succeeded",
        "inv-3": "reconciliation_required",
    }
    assert not Event.objects.filter(invocation__invocation_id="inv-2", kind="evidence_missing")


def test_a_unit_that_keeps_losing_races_is_flagged_one_invocation_at_a_time(
    api: Api, three_in_flight: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = store.write
    lost: list[int] = []

    def busy(writes: store.Writes) -> None:
        # Outcomes keep arriving somewhere in every unit of several invocations.
        if len(writes.updated) > 1:
            lost.append(len(writes.updated))
            raise store.RaceLost
        write(writes)

    monkeypatch.setattr(store, "write", busy)

    assert sweeper.sweep(now=past_deadline()) == 3

    assert lost == [3] * services.RACE_RETRIES
    assert set(statuses().values()) == {"reconciliation_required"}


def count_fewer_events(invocation_id: str) -> None:
    """A row edited outside the ledger so that its next event's number is taken."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE ledger_invocation SET event_count = 1 WHERE invocation_id = %s",
            [invocation_id],
        )


def test_a_row_tampered_with_is_skipped_and_logged_and_the_rest_reconciled(
    api: Api, three_in_flight: None, caplog: pytest.LogCaptureFixture
) -> None:
    """One broken invocation does not stop the flags, the leases and the probes of all."""
    count_fewer_events("inv-2")
    now = past_deadline()
    assert sweeper.sweep(now=now) == 2
    assert statuses() == {
        "inv-1": "reconciliation_required",
        "inv-2": "in_flight",
        "inv-3": "reconciliation_required",
    }
    assert (
        "sweep skipped invocation=inv-2 step=flag_missing_evidence error=projection_broken"
        in caplog.text
    )

    for invocation_id in ("inv-1", "inv-3"):
        assert reconciliation.services.invocation_claim(
            invocation_id=invocation_id, worker="w", now=now
        )
    count_fewer_events("inv-3")
    assert sweeper.expire_leases(now=now + dt.timedelta(days=1)) == 1
    assert Invocation.objects.get(invocation_id="inv-1").lease_owner == ""
    assert "sweep skipped invocation=inv-3 step=expire_lease error=projection_broken" in (
        caplog.text
    )
    count_fewer_events("inv-1")
    assert reconcile_invocation("inv-1") == "refused: projection_broken"
    assert "probe refused invocation=inv-1 error=projection_broken" in caplog.text


def test_a_refusal_is_logged_again_only_after_a_while(
    api: Api, three_in_flight: None, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """Beat sweeps every few seconds; a row refused until an admin restores it would
    otherwise log the same error each time."""
    clock = [timezone.now()]
    monkeypatch.setattr(db_cache, "tz_now", lambda: clock[0])  # the cache's clock
    count_fewer_events("inv-2")
    now = past_deadline()
    for _ in range(3):
        sweeper.sweep(now=now)
        clock[0] += dt.timedelta(seconds=5)
    assert caplog.text.count("sweep skipped invocation=inv-2") == 1
    clock[0] += dt.timedelta(seconds=sweeper.LOG_AGAIN_AFTER_SECONDS)
    sweeper.sweep(now=now)
    assert caplog.text.count("sweep skipped invocation=inv-2") == 2


@pytest.mark.django_db(transaction=True)
def test_a_refusal_one_worker_logged_is_not_logged_again_by_another(
    api: Api, refund: Capability, caplog: pytest.LogCaptureFixture
) -> None:
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k{n}", attempt_id="a1")
    count_fewer_events("inv-2")
    now = past_deadline()
    sweeper.sweep(now=now)
    assert caplog.text.count("sweep skipped invocation=inv-2") == 1
    another = subprocess.run(
        [sys.executable, "-c", SWEEP_AT.format(now=now.isoformat())],
        cwd=ROOT, env={**process_env(), "LOG_LEVEL": "INFO"}, capture_output=True, text=True,
    )  # fmt: skip
    assert another.returncode == 0, another.stderr
    assert "sweep skipped" not in another.stderr
    # It swept all the same: inv-1 was flagged by the first, and the second ran.
    assert "sweep done" in another.stdout


SWEEP_AT = (
    "import datetime as dt, django; django.setup(); from reconciliation import sweeper; "
    "sweeper.sweep(now=dt.datetime.fromisoformat('{now}')); print('sweep done')"
)


def test_a_whole_round_of_rows_tampered_with_does_not_stop_the_sweep(
    api: Api, three_in_flight: None, caplog: pytest.LogCaptureFixture
) -> None:
    count_fewer_events("inv-1")
    count_fewer_events("inv-2")
    # The two oldest deadlines fill the first round, and both are refused.
    assert sweeper.sweep(now=past_deadline(), batch=2) == 1
    assert statuses() == {
        "inv-1": "in_flight",
        "inv-2": "in_flight",
        "inv-3": "reconciliation_required",
    }
    assert caplog.text.count("sweep skipped invocation=") == 2


def test_a_probe_job_is_not_sent_again_while_it_waits_to_be_started(
    api: Api, three_in_flight: None
) -> None:
    flagged_at = past_deadline()
    assert sweeper.sweep(now=flagged_at) == 3
    sent: list[str] = []
    assert sweeper.send_due_probes(sent.append, now=flagged_at) == ["inv-1", "inv-2", "inv-3"]
    # Workers busy with probes hanging in an outage: the next sweeps send nothing more.
    for seconds in (5, 10, 55):
        later = flagged_at + dt.timedelta(seconds=seconds)
        assert sweeper.send_due_probes(sent.append, now=later) == []
    assert len(sent) == 3

    # inv-2's job ran, and the business system did not answer: its retry is sent when due.
    probed_at = flagged_at + dt.timedelta(seconds=20)
    assert reconciliation.services.invocation_claim(
        invocation_id="inv-2", worker="w", now=probed_at
    )
    assert reconciliation.services.record_probe_result(
        invocation_id="inv-2", worker="w", result=ProbeResult(Finding.INCONCLUSIVE), now=probed_at
    )
    retry_at = Invocation.objects.get(invocation_id="inv-2").next_probe_at
    assert retry_at is not None
    assert sweeper.send_due_probes(sent.append, now=retry_at) == ["inv-2"]
    # The jobs of inv-1 and inv-3, never started a lease after they were sent, were lost.
    lost = flagged_at + dt.timedelta(seconds=settings.LEDGER_PROBE_LEASE_SECONDS)
    assert sweeper.send_due_probes(sent.append, now=lost) == ["inv-1", "inv-3"]
    assert sent == ["inv-1", "inv-2", "inv-3", "inv-2", "inv-1", "inv-3"]


def waiting_jobs() -> dict[str, int]:
    return dict(ProbeDispatch.objects.values_list("invocation__invocation_id", "event_count"))


def test_only_probe_jobs_still_waiting_are_remembered(api: Api, three_in_flight: None) -> None:
    flagged_at = past_deadline()
    sweeper.sweep(now=flagged_at)
    sweeper.send_due_probes(lambda invocation_id: None, now=flagged_at)
    flagged = waiting_jobs()
    assert set(flagged) == {"inv-1", "inv-2", "inv-3"}

    # inv-1's job ran and settled it; inv-2's was claimed and is still probing.
    probed_at = flagged_at + dt.timedelta(seconds=1)
    for invocation_id in ("inv-1", "inv-2"):
        assert reconciliation.services.invocation_claim(
            invocation_id=invocation_id, worker="w", now=probed_at
        )
    assert reconciliation.services.record_probe_result(
        invocation_id="inv-1",
        worker="w",
        result=ProbeResult(Finding.PRESENT, business_reference="RF-1"),
        now=probed_at,
    )
    assert sweeper.send_due_probes(lambda invocation_id: None, now=probed_at) == []
    # Both of their jobs are spent; inv-3's still waits, as it was sent.
    assert waiting_jobs() == {"inv-3": flagged["inv-3"]}
    assert status_of("inv-1") == "succeeded"


def test_sweeps_in_an_outage_queue_one_probe_job_per_flagged_invocation(
    api: Api, three_in_flight: None, broker_queue: BrokerQueue
) -> None:
    # Flagged now, so that the beat's task, which reads the clock, finds them due.
    Invocation.objects.update(deadline_at=timezone.now() - dt.timedelta(seconds=1))
    for _ in range(4):  # no worker takes them: what an outage looks like to the broker
        sweep_overdue_attempts.run()
    assert set(statuses().values()) == {"reconciliation_required"}
    assert broker_queue.jobs() == 3


def test_the_overdue_query_uses_the_partial_index_on_a_table_of_terminal_rows(
    api: Api, refund: Capability
) -> None:
    api.intent(attempt_id="a1")
    invocation = Invocation.objects.get()
    with connection.cursor() as cursor:
        # 50,000 terminal invocations, written directly: the sweep must not read them.
        cursor.execute(
            """
            INSERT INTO ledger_invocation (
                invocation_id, runtime_id, task_id, capability_scope, subject,
                idempotency_key, arguments_digest, traceparent, created_at, hint_readonly,
                hint_idempotency_verified, max_attempts, timeout_ms, grace_ms, risk_level,
                status, failure_class, cause, resolution, flags, attempt_count,
                in_flight_attempt, event_count, head_hash, updated_at, lease_owner, probe_tries)
            SELECT 'bulk-' || n, %s, 't', 'refund.create', '', 'bulk-' || n, 'sha256:x', '',
                   now(), false, false, 5, 30000, 60000, 'high', 'succeeded', '', '', '',
                   '{}', 1, '', 3, 'h', now(), '', 0
            FROM generate_series(1, 50000) AS n
            """,
            [invocation.runtime_id],  # type: ignore[attr-defined]
        )
        cursor.execute("ANALYZE ledger_invocation")
        query = Invocation.objects.overdue(past_deadline()).order_by("deadline_at")[:500]
        sql, params = query.values_list("invocation_id").query.sql_with_params()
        cursor.execute("EXPLAIN " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "invocation_in_flight_deadline" in plan, plan
    assert "Seq Scan" not in plan, plan


@pytest.mark.django_db(transaction=True)
def test_a_real_worker_runs_the_sweep_delivered_by_the_broker(
    api: Api, refund: Capability, workers: Workers
) -> None:
    workers.start()
    api.intent(attempt_id="a1", arguments={"amount": 1})
    # Make the deadline pass now instead of in 90 seconds.
    Invocation.objects.filter(invocation_id="inv-1").update(
        deadline_at=timezone.now() - dt.timedelta(seconds=1)
    )
    sweep_overdue_attempts.delay()
    # The sweep flags it, then hands it to reconciliation; with no probe configured
    # for this capability, reconciliation hands it to a person.
    wait_for(lambda: status_of("inv-1") == "escalated")
    invocation = Invocation.objects.get()
    assert invocation.cause == "no_probe"
    kinds = list(invocation.events.order_by("seq").values_list("kind", "actor"))
    assert kinds[2][0] == "evidence_missing" and kinds[2][1] == "ledger:sweeper"
    assert [k for k, _ in kinds[3:]] == ["reconciliation_claimed", "probe_run"]
