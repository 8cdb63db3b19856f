"""Prometheus metrics at /metrics: figures an operator alerts on, read from the ledger."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from pytest_django import DjangoAssertNumQueries
from pytest_django.fixtures import Settings

from ledger import metrics
from ledger.capabilities import capability_settings_change
from ledger.integrity import seal_events, verify_next_slice
from ledger.metrics import exposition
from ledger.models import REOPENED_CLAIM_KINDS, Capability, Event, Invocation, Seal
from ledger.rate_limits import watch_rate_limits
from ledger.services import flag_missing_evidence
from ledger.shared_references import watch_shared_references
from reconciliation.services import expire_lease, invocation_claim, release_lost_claim
from reconciliation.tasks import reconcile_invocation
from tests.conftest import Api, registered
from tests.ledger.conftest import superuser_sql


def samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def scrape(client: Client, **headers: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    return samples(response.content)


def flagged(api: Api, invocation_id: str) -> Invocation:
    api.intent(invocation_id=invocation_id, idempotency_key=f"k-{invocation_id}", attempt_id="a1")
    deadline = Invocation.objects.get(invocation_id=invocation_id).deadline_at
    assert deadline is not None and flag_missing_evidence(invocation_id=invocation_id, now=deadline)
    return Invocation.objects.get(invocation_id=invocation_id)


def test_the_figures_are_the_ledgers(api: Api, refund: Capability, client: Client) -> None:
    assert scrape(client)[("ledger_invocations_in_flight", ())] == 0
    waiting = flagged(api, "inv-waiting")
    flagged(api, "inv-no-probe")
    reconcile_invocation.run("inv-no-probe")  # refund.create has no probe: escalated
    api.intent(invocation_id="inv-flying", idempotency_key="k-flying", attempt_id="a1")
    api.intent(invocation_id="inv-recorded", idempotency_key="k-recorded")
    seal_events()
    api.intent(invocation_id="inv-after-seal", idempotency_key="k-after-seal")
    flying = Invocation.objects.get(invocation_id="inv-flying")
    assert flying.deadline_at is not None

    before_deadline = samples(exposition(now=flying.deadline_at - dt.timedelta(seconds=1)))
    at_deadline = samples(exposition(now=flying.deadline_at))

    flagged_by_status = {
        labels[0][1]: value
        for (name, labels), value in at_deadline.items()
        if name == "ledger_invocations_flagged"
    }
    assert flagged_by_status == {
        "reconciliation_required": 1,
        "reconciling": 0,
        "escalated": 1,
        "resolution_proposed": 0,
    }
    # Each was flagged at its deadline, 90 s ahead, inv-waiting first. inv-no-probe's
    # escalation, just now, touched it last but did not restart its wait.
    escalated = Invocation.objects.get(invocation_id="inv-no-probe")
    assert waiting.flagged_at is not None and escalated.flagged_at is not None
    assert escalated.updated_at < waiting.flagged_at < escalated.flagged_at
    waited = (flying.deadline_at - waiting.flagged_at).total_seconds()
    assert at_deadline[("ledger_invocations_flagged_oldest_seconds", ())] == pytest.approx(waited)
    assert at_deadline[("ledger_invocations_in_flight", ())] == 1
    assert before_deadline[("ledger_invocations_overdue", ())] == 0
    assert at_deadline[("ledger_invocations_overdue", ())] == 1
    no_probe = (("capability", ""), ("finding", "none"))
    assert at_deadline[("ledger_probe_runs_last_hour", no_probe)] == 1
    seal = Seal.objects.get()
    assert Event.objects.filter(sealed__isnull=True).exists()  # inv-after-seal's
    newest_event = Event.objects.latest("created_at")
    assert at_deadline[("ledger_seal_last_timestamp_seconds", ())] == seal.created_at.timestamp()
    assert at_deadline[("ledger_event_last_timestamp_seconds", ())] == (
        newest_event.created_at.timestamp()
    )


def test_an_empty_ledger_answers_zeros(db: None, client: Client) -> None:
    figures = scrape(client)
    assert figures[("ledger_seal_last_timestamp_seconds", ())] == 0
    assert figures[("ledger_invocations_flagged_oldest_seconds", ())] == 0
    assert not any(name == "ledger_probe_runs_last_hour" for name, _ in figures)


def test_a_scrape_costs_the_same_statements_however_much_is_recorded(
    api: Api, refund: Capability, client: Client, django_assert_num_queries: DjangoAssertNumQueries
) -> None:
    for n in range(5):
        flagged(api, f"inv-{n}")
    seal_events()
    verify_next_slice(invocations=2)
    watch_shared_references()
    with django_assert_num_queries(15):
        scrape(client)


def test_each_enforced_rate_limits_window_is_counted(
    api: Api, client: Client, django_assert_num_queries: DjangoAssertNumQueries
) -> None:
    """Refusals record nothing: a window at its count is what shows them."""
    for scope, count in [("refund.create", 2), ("payout.create", 5), ("order.cancel", 3)]:
        registered(scope, rate_limit={"count": count, "window": "1h"})
    for scope in ("refund.create", "payout.create"):
        capability_settings_change(
            scope=scope, actor="user:ada", reason="the business system's", rate_limit_enforced=True
        )
    for n in range(3):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    api.intent(invocation_id="inv-p", capability="payout.create", idempotency_key="k-p",
               attempt_id="a1")  # fmt: skip
    with django_assert_num_queries(17):  # both windows in one statement
        figures = scrape(client)
    windows = {
        (name, dict(labels)["capability"]): value
        for (name, labels), value in figures.items()
        if name.startswith("ledger_rate_limit_window_")
    }
    assert windows == {
        ("ledger_rate_limit_window_admissions", "refund.create"): 2,  # the third was refused
        ("ledger_rate_limit_window_count", "refund.create"): 2,
        ("ledger_rate_limit_window_admissions", "payout.create"): 1,
        ("ledger_rate_limit_window_count", "payout.create"): 5,
    }


def test_shared_references_of_the_last_hour_are_counted_by_kind(
    api: Api, api_b: Api, refund: Capability
) -> None:
    for n, runtime in ((1, api), (2, api), (3, api_b)):
        runtime.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        runtime.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference="RF-1")
    recorded = Event.objects.filter(kind="outcome_recorded").latest("created_at").created_at

    now = samples(exposition(now=recorded))
    later = samples(exposition(now=recorded + dt.timedelta(hours=1, seconds=1)))

    # inv-2 names inv-1 by id; inv-3, of another runtime, counts both.
    assert now[("ledger_shared_references_last_hour", (("kind", "outcome_recorded"),))] == 2
    assert not any(name == "ledger_shared_references_last_hour" for name, _ in later)


def test_probe_claims_reopened_in_the_last_hour_are_counted_by_reason(
    api: Api, refund: Capability
) -> None:
    """A worker killed while probing is found gone by the sweep; one that hangs holds
    its claim until its lease runs out. Each reopened claim is a probe sent again."""
    for invocation_id in ("inv-killed", "inv-hung", "inv-probed"):
        flagged(api, invocation_id)
    now = timezone.now()
    for invocation_id in ("inv-killed", "inv-hung"):
        assert invocation_claim(invocation_id=invocation_id, worker="w1", now=now)
    # No session holds inv-killed's probe lock: the sweep finds its worker gone.
    assert release_lost_claim(invocation_id="inv-killed", now=now)
    assert expire_lease(invocation_id="inv-hung", now=now + dt.timedelta(seconds=61))
    reopened_at = Event.objects.filter(kind__in=REOPENED_CLAIM_KINDS).latest("created_at")

    def reopened(at: dt.datetime) -> dict[str, float]:
        return {
            dict(labels)["reason"]: value
            for (name, labels), value in samples(exposition(now=at)).items()
            if name == "ledger_probe_claims_reopened_last_hour"
        }

    assert reopened(reopened_at.created_at) == {"probe_worker_lost": 1, "lease_expired": 1}
    an_hour_later = reopened_at.created_at + dt.timedelta(hours=1, seconds=1)
    assert reopened(an_hour_later) == {"probe_worker_lost": 0, "lease_expired": 0}

    with transaction.atomic(), connection.cursor() as cursor:
        # The tables here are tiny: ask whether each month's index can serve at all.
        for method in ("seqscan", "bitmapscan"):
            cursor.execute(f"SET LOCAL enable_{method} = off")
        plan = Event.objects.filter(kind__in=REOPENED_CLAIM_KINDS, created_at__gte=now).explain()
    scanned = re.findall(r" on (ledger_event_\w+) ", plan)
    through_the_index = re.findall(r"using (ledger_event_\w+)_event_claim_reopened_time on", plan)
    assert len(scanned) > 1 and through_the_index == scanned, plan


def behind(figures: dict[tuple[str, tuple[tuple[str, str], ...]], float], work: str) -> float:
    return figures[("ledger_background_behind", (("work", work),))]


def test_a_sweeper_that_stopped_is_reported_behind(api: Api, refund: Capability) -> None:
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    deadline = Invocation.objects.get().deadline_at
    assert deadline is not None
    just_due = samples(exposition(now=deadline + dt.timedelta(seconds=5)))
    assert just_due[("ledger_invocations_overdue", ())] == 1
    assert just_due[("ledger_invocations_overdue_oldest_seconds", ())] == 5
    assert behind(just_due, "sweeper") == 0  # the next sweep takes it
    stalled = samples(exposition(now=deadline + dt.timedelta(seconds=61)))
    assert behind(stalled, "sweeper") == 1
    assert flag_missing_evidence(invocation_id="inv-1", now=deadline + dt.timedelta(seconds=61))
    swept = samples(exposition(now=deadline + dt.timedelta(seconds=62)))
    assert swept[("ledger_invocations_overdue", ())] == 0 and behind(swept, "sweeper") == 0


def refused_and_due(api: Api) -> dt.datetime:
    """inv-1 and inv-2 in flight; inv-1 ten minutes overdue when inv-2 falls due, and
    changed outside the ledger. Returns inv-2's deadline."""
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    deadline = Invocation.objects.get(invocation_id="inv-2").deadline_at
    assert deadline is not None
    Invocation.objects.filter(invocation_id="inv-1").update(
        deadline_at=deadline - dt.timedelta(minutes=10), head_hash="0" * 64
    )
    return deadline


def test_a_row_the_sweep_refuses_is_counted_apart_and_does_not_make_it_behind(
    api: Api, refund: Capability, django_assert_num_queries: DjangoAssertNumQueries
) -> None:
    """inv-1, its attempt long overdue, was changed outside the ledger: the sweep
    refuses it until an admin restores it, which is no sign that beat stopped."""
    deadline = refused_and_due(api)

    # The fifteen, the first event's time (no seal yet), and the oldest overdue rows
    # with their events.
    with django_assert_num_queries(17):
        just_due = samples(exposition(now=deadline + dt.timedelta(seconds=5)))
    assert just_due[("ledger_invocations_overdue", ())] == 2
    assert just_due[("ledger_invocations_overdue_oldest_seconds", ())] == 605
    assert just_due[("ledger_invocations_overdue_refused", ())] == 1
    assert behind(just_due, "sweeper") == 0
    # inv-2, which the sweep can flag, waits past a minute: now beat is behind.
    stalled = samples(exposition(now=deadline + dt.timedelta(seconds=61)))
    assert behind(stalled, "sweeper") == 1
    assert flag_missing_evidence(invocation_id="inv-2", now=deadline + dt.timedelta(seconds=61))
    swept = samples(exposition(now=deadline + dt.timedelta(seconds=62)))
    assert swept[("ledger_invocations_overdue", ())] == 1
    assert swept[("ledger_invocations_overdue_refused", ())] == 1
    assert behind(swept, "sweeper") == 0


def test_when_every_row_read_is_refused_the_sweeper_is_taken_as_behind(
    api: Api, refund: Capability, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past OVERDUE_READ refused rows the ledger cannot tell how old the oldest row the
    sweep could flag is, and says behind rather than keeping up."""
    monkeypatch.setattr(metrics, "OVERDUE_READ", 1)
    deadline = refused_and_due(api)

    figures = samples(exposition(now=deadline + dt.timedelta(seconds=5)))

    assert figures[("ledger_invocations_overdue_refused", ())] == 1
    assert behind(figures, "sweeper") == 1


def test_a_sealer_that_stopped_is_reported_behind(api: Api, refund: Capability) -> None:
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    first_event = Event.objects.get(seq=1).created_at
    # No seal yet: behind once the first event has waited over ten minutes.
    assert behind(samples(exposition(now=first_event + dt.timedelta(minutes=9))), "sealer") == 0
    assert behind(samples(exposition(now=first_event + dt.timedelta(minutes=11))), "sealer") == 1
    seal = seal_events()
    assert seal is not None
    assert behind(samples(exposition()), "sealer") == 0
    # An event recorded eleven minutes after the newest seal, which no sealer took.
    late = seal.created_at + dt.timedelta(minutes=11)
    assert flag_missing_evidence(invocation_id="inv-1", now=late)
    assert behind(samples(exposition(now=late)), "sealer") == 1
    assert seal_events(now=late) is not None
    assert behind(samples(exposition(now=late)), "sealer") == 0


@pytest.mark.rewrites_history
def test_breaks_found_by_background_verification_are_reported(ledger: Api) -> None:
    assert samples(exposition())[("ledger_verification_finished_timestamp_seconds", ())] == 0
    superuser_sql("UPDATE ledger_invocation SET status = 'failed' WHERE invocation_id = 'inv-3'")
    running = verify_next_slice(invocations=3)
    assert running is not None and running.finished_at is None
    figures = samples(exposition())
    assert figures[("ledger_verification_breaks", (("pass", "running"),))] == 1
    assert figures[("ledger_verification_breaks", (("pass", "finished"),))] == 0
    finished = verify_next_slice(invocations=3)
    assert finished is not None and finished.finished_at is not None
    started = verify_next_slice(invocations=2)  # the next pass, clean so far
    assert started is not None and started.pk != finished.pk
    figures = samples(exposition())
    assert figures[("ledger_verification_breaks", (("pass", "finished"),))] == 1
    assert figures[("ledger_verification_breaks", (("pass", "running"),))] == 0
    assert figures[("ledger_verification_finished_timestamp_seconds", ())] == (
        finished.finished_at.timestamp()
    )


def test_a_verifier_that_stopped_is_reported_behind(ledger: Api, settings: Settings) -> None:
    settings.LEDGER_VERIFY_INTERVAL_SECONDS = 60
    assert behind(samples(exposition()), "verifier") == 0  # nothing verified yet
    verified = verify_next_slice(invocations=1)
    assert verified is not None
    at = verified.checked_at
    assert behind(samples(exposition(now=at + dt.timedelta(minutes=9))), "verifier") == 0
    assert behind(samples(exposition(now=at + dt.timedelta(minutes=11))), "verifier") == 1
    assert verify_next_slice(invocations=1, now=at + dt.timedelta(minutes=11)) is not None
    assert behind(samples(exposition(now=at + dt.timedelta(minutes=11))), "verifier") == 0


def test_a_rate_watch_that_stopped_is_reported_behind_and_waiting_breaches_counted(
    api: Api, settings: Settings, django_assert_num_queries: DjangoAssertNumQueries
) -> None:
    settings.LEDGER_RATE_WATCH_INTERVAL_SECONDS = 60
    registered("refund.create", rate_limit={"count": 1, "window": "1h"})
    assert behind(samples(exposition()), "rate_watch") == 0  # no watch yet
    watch_rate_limits()
    for n in (1, 2, 3):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    sealed = seal_events()
    assert sealed is not None
    at = sealed.created_at
    watch_shared_references()
    # The fifteen, the oldest overdue rows (the attempts are overdue by then), and the
    # seal the watch should have read past.
    with django_assert_num_queries(17):
        assert behind(samples(exposition(now=at + dt.timedelta(minutes=9))), "rate_watch") == 0
    stalled = samples(exposition(now=at + dt.timedelta(minutes=11)))
    assert behind(stalled, "rate_watch") == 1
    superuser_sql(
        "UPDATE ledger_invocation SET flags = '{undeclared}' WHERE invocation_id = 'inv-3'"
    )
    assert watch_rate_limits().flagged == ["inv-2"]
    caught_up = samples(exposition(now=at + dt.timedelta(minutes=11)))
    assert behind(caught_up, "rate_watch") == 0
    assert caught_up[("ledger_rate_limit_breaches_unrecorded", ())] == 1


def test_with_a_token_set_a_scrape_must_present_it(
    db: None, client: Client, settings: Settings
) -> None:
    settings.LEDGER_METRICS_TOKEN = "scrape-secret"
    assert client.get("/metrics").status_code == 401
    wrong = client.get("/metrics", headers={"Authorization": "Bearer scrape-guess"})
    assert wrong.status_code == 401 and b"ledger_" not in wrong.content
    bare = client.get("/metrics", headers={"Authorization": "scrape-secret"})
    assert bare.status_code == 401
    assert ("ledger_invocations_in_flight", ()) in scrape(
        client, Authorization="Bearer scrape-secret"
    )


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_database_answers_503(client: Client, unreachable_database: None) -> None:
    response = client.get("/metrics")
    assert response.status_code == 503 and b"database unavailable" in response.content


def test_a_reference_watch_that_stopped_is_reported_behind_and_waiting_flags_counted(
    api: Api,
    refund: Capability,
    settings: Settings,
    django_assert_num_queries: DjangoAssertNumQueries,
) -> None:
    settings.LEDGER_REFERENCE_WATCH_INTERVAL_SECONDS = 60
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        api.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference="RF-1")
    sealed = seal_events()
    assert sealed is not None
    at = sealed.created_at
    assert behind(samples(exposition(now=at + dt.timedelta(minutes=9))), "reference_watch") == 0
    # The fifteen, and the seal the watch should have read past: it has read none.
    with django_assert_num_queries(16):
        stalled = samples(exposition(now=at + dt.timedelta(minutes=11)))
    assert behind(stalled, "reference_watch") == 1
    superuser_sql(
        "UPDATE ledger_invocation SET flags = '{undeclared}' WHERE invocation_id = 'inv-1'"
    )
    assert watch_shared_references().unrecorded == 1
    caught_up = samples(exposition(now=at + dt.timedelta(minutes=11)))
    assert behind(caught_up, "reference_watch") == 0
    assert caught_up[("ledger_shared_references_unrecorded", ())] == 1
