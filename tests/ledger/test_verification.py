"""Background verification: beat's task checks the whole ledger a slice at a time, and
each kind of tampering is found by the pass that reaches it, without anyone asking.
The action log is a hash chain too, checked by both verifications."""

from __future__ import annotations

import datetime as dt
import io
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.utils import ProgrammingError
from django.utils import timezone

from ledger import integrity
from ledger.chain import GENESIS_HASH, event_hash
from ledger.integrity import (
    CLEAN_PASSES_KEPT,
    restore_projection,
    seal_events,
    verify,
    verify_next_slice,
    verify_slices_for,
)
from ledger.models import AdminAction, Event, Invocation, RuntimeToken, Seal, VerificationPass
from tests.conftest import Api, person
from tests.ledger.conftest import at_migration, superuser_sql


def whole_pass(slice_size: int = 2) -> VerificationPass:
    """Slices until the running pass finishes; the finished pass."""
    for _ in range(100):
        verified = verify_next_slice(invocations=slice_size)
        assert verified is not None
        if verified.finished_at is not None:
            return verified
    raise AssertionError("the pass never finished")


def said(verified: VerificationPass) -> list[str]:
    """The pass's breaks as verify_ledger prints them."""
    return [broken["break"] for broken in verified.breaks]


def test_it_checks_every_invocation_event_and_seal_a_slice_at_a_time(ledger: Api) -> None:
    first = verify_next_slice(invocations=3)
    assert first is not None and first.finished_at is None
    assert (first.invocations, first.seals) == (3, 1)
    assert first.after_invocation == Invocation.objects.get(invocation_id="inv-3").pk
    second = verify_next_slice(invocations=3)
    assert second is not None and second.pk == first.pk
    assert second.finished_at is not None
    assert (second.invocations, second.events, second.seals) == (4, Event.objects.count(), 1)
    assert (second.break_count, second.breaks) == (0, [])


def test_a_pass_covers_the_ledger_as_it_was_when_it_started(ledger: Api) -> None:
    started = verify_next_slice(invocations=2)
    assert started is not None and started.finished_at is None
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5")
    finished = whole_pass(slice_size=3)  # room for inv-5 too: it is left out
    assert (finished.pk, finished.invocations) == (started.pk, 4)
    following = whole_pass()
    assert following.pk != started.pk
    assert following.invocations == 5


def test_an_event_appended_while_a_slice_reads_is_no_break(
    ledger: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slice reads the chains, then their rows: an attempt admitted in between moves
    a row past its chain as read. The slice compares that row with its chain read
    again, not with the older one."""
    read_chains = integrity._chains

    def then_an_attempt_is_admitted(events: Any) -> Any:
        yield from read_chains(events)
        assert ledger.attempt("inv-4", "a1")[0] == 201

    with monkeypatch.context() as patch:
        patch.setattr(integrity, "_chains", then_an_attempt_is_admitted)
        finished = whole_pass(slice_size=4)
    assert said(finished) == []
    assert (finished.invocations, finished.events) == (4, Event.objects.count())
    assert Invocation.objects.get(invocation_id="inv-4").status == "in_flight"


@pytest.mark.rewrites_history
def test_it_finds_and_logs_a_row_changed_outside_the_ledger(
    ledger: Api, caplog: pytest.LogCaptureFixture
) -> None:
    superuser_sql("UPDATE ledger_invocation SET status = 'failed' WHERE invocation_id = 'inv-2'")
    with caplog.at_level(logging.ERROR, logger="ledger.integrity"):
        finished = whole_pass()
    assert finished.break_count == 1
    assert finished.breaks == [
        {
            "break": "projection broken at invocation inv-2 status: expected 'succeeded', "
            "found 'failed'",
            "invocation_id": "inv-2",
        }
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"verification pass={finished.pk} {said(finished)[0]}"
    ]


@pytest.mark.rewrites_history
def test_it_finds_an_invocation_whose_events_were_deleted(ledger: Api) -> None:
    superuser_sql(
        "DELETE FROM ledger_event WHERE invocation_id = "
        "(SELECT id FROM ledger_invocation WHERE invocation_id = 'inv-4')"
    )
    finished = whole_pass()
    assert finished.breaks == [
        {
            "break": "chain broken at invocation inv-4: expected its intent event at least, "
            "found no event",
            "invocation_id": "inv-4",
        }
    ]
    assert finished.invocations == 4


@pytest.mark.rewrites_history
def test_it_finds_an_event_rewritten_and_a_seal_rewritten(ledger: Api) -> None:
    superuser_sql(
        "UPDATE ledger_event SET data = jsonb_set(data, '{business_reference}', '\"RF-X\"') "
        "WHERE kind = 'outcome_recorded' AND invocation_id = "
        "(SELECT id FROM ledger_invocation WHERE invocation_id = 'inv-1')"
    )
    superuser_sql("UPDATE ledger_seal SET event_count = event_count + 1")
    seal = Seal.objects.get()
    finished = whole_pass()
    where = f"seal {seal.pk} (sequence {seal.first_sequence}-{seal.last_sequence})"
    assert [broken.split(": expected ")[0] for broken in said(finished)] == [
        "chain broken at invocation inv-1 event #3",
        f"seal broken at {where}",
        f"seal broken at {where}",
    ]
    assert said(finished)[1].endswith(f"over {seal.event_count - 1} events")
    assert said(finished)[2].endswith(f"found hash {seal.hash}")
    assert [broken["invocation_id"] for broken in finished.breaks] == ["inv-1", None, None]


@pytest.mark.rewrites_history
def test_it_finds_a_seal_that_does_not_follow_the_one_before(ledger: Api) -> None:
    first = Seal.objects.get()
    second = seal_events()  # inv-4's intent, which the fixture left unsealed
    assert second is not None
    superuser_sql("UPDATE ledger_seal SET prev_hash = %s WHERE id = %s", "f" * 64, second.pk)
    finished = whole_pass()
    where = f"seal {second.pk} (sequence {second.first_sequence}-{second.last_sequence})"
    assert said(finished)[0] == (
        f"seal broken at {where}: expected prev_hash {first.hash}, found {'f' * 64}"
    )
    # The seal's own hash covers its prev_hash: it no longer verifies either.
    assert said(finished)[1].startswith(f"seal broken at {where}: expected hash ")
    assert finished.break_count == 2


@pytest.mark.rewrites_history
def test_the_breaks_kept_are_the_first_and_all_are_counted(ledger: Api) -> None:
    # A pass that found more than it keeps still counts every one.
    running = verify_next_slice(invocations=1)
    assert running is not None
    VerificationPass.objects.filter(pk=running.pk).update(
        breaks=["earlier"] * VerificationPass.BREAKS_KEPT,
        break_count=VerificationPass.BREAKS_KEPT,
    )
    superuser_sql("UPDATE ledger_invocation SET status = 'failed' WHERE invocation_id = 'inv-3'")
    finished = whole_pass()
    assert finished.break_count == VerificationPass.BREAKS_KEPT + 1
    assert finished.breaks == ["earlier"] * VerificationPass.BREAKS_KEPT


def test_old_clean_passes_are_forgotten_and_passes_that_found_breaks_are_kept(
    ledger: Api,
) -> None:
    found = whole_pass()
    VerificationPass.objects.filter(pk=found.pk).update(break_count=1, breaks=["kept"])
    for _ in range(CLEAN_PASSES_KEPT + 2):
        whole_pass(slice_size=10)
    clean = VerificationPass.objects.filter(break_count=0)
    assert clean.count() == CLEAN_PASSES_KEPT
    assert VerificationPass.objects.filter(pk=found.pk).exists()
    newest = VerificationPass.objects.order_by("-started_at").first()
    assert newest is not None and newest.finished_at is not None


@pytest.mark.django_db(transaction=True)
def test_a_run_while_another_holds_the_lock_does_nothing(ledger: Api) -> None:
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=False) as other:
        other.execute("SELECT pg_advisory_xact_lock(hashtext('ledger.verify_next_slice'))")
        assert verify_next_slice(invocations=10) is None
        assert verify_slices_for(seconds=60, invocations=10) == 0
        assert not VerificationPass.objects.exists()
    assert verify_next_slice(invocations=10) is not None


def test_a_running_pass_says_how_far_it_has_come_and_when_it_should_end(
    ledger: Api,
) -> None:
    started = timezone.now() - dt.timedelta(minutes=30)
    running = verify_next_slice(invocations=1, now=started)
    assert running is not None and running.invocations_to_check == 4
    assert running.expected_end() is None  # no pace yet
    # A quarter in ten minutes and ten seconds: the rest take three times that, and
    # end ten minutes and forty seconds from now.
    running.invocations, running.invocations_to_check = 250_000, 1_000_000
    running.checked_at = started + dt.timedelta(minutes=10, seconds=10)
    assert running.expected_end() == started + dt.timedelta(minutes=40, seconds=40)
    running.save()

    card = (
        person("carol", "compliance")
        .get("/audit/verify/")
        .content.decode()
        .split('id="background-verification"')[1]
    )
    assert (
        "Running for 30\xa0minutes: 250,000 of 1,000,000 invocations checked so far, "
        "10\xa0minutes more at this pace."
    ) in card
    running.finished_at = timezone.now()
    assert running.expected_end() is None


def test_a_run_checks_slices_for_its_time_and_stops_at_the_end_of_its_pass(
    ledger: Api,
) -> None:
    assert verify_slices_for(seconds=0, invocations=1) == 1
    running = VerificationPass.objects.get()
    assert (running.invocations, running.finished_at) == (1, None)

    # Time for many more: the pass's other three invocations, a slice each, and no
    # second pass over a ledger that was just verified whole.
    assert verify_slices_for(seconds=600, invocations=1) == 3
    finished = VerificationPass.objects.get()
    assert (finished.invocations, finished.events, finished.break_count) == (4, 10, 0)
    assert finished.finished_at is not None

    assert verify_slices_for(seconds=600, invocations=3) == 2
    assert VerificationPass.objects.filter(finished_at__isnull=False).count() == 2


@pytest.mark.rewrites_history
def test_the_verify_page_shows_what_the_background_passes_found(ledger: Api) -> None:
    compliance = person("carol", "compliance")
    assert "No whole pass yet." in compliance.get("/audit/verify/").content.decode()
    superuser_sql("UPDATE ledger_invocation SET status = 'failed' WHERE invocation_id = 'inv-2'")
    whole_pass()
    assert verify_next_slice(invocations=1) is not None  # the next pass, clean so far

    page = compliance.get("/audit/verify/").content.decode()

    card = page.split('id="background-verification"')[1].split("</section>")[0]
    assert (
        "4 invocations, 10 events, 1 seal, 1 admin action and 1 capability,\n      1 break found:"
        in card
    )
    assert (
        "<li><code>projection broken at invocation inv-2 status: expected &#x27;succeeded&#x27;, "
        'found &#x27;failed&#x27;</code> <a href="/invocations/inv-2/">its page</a></li>'
    ) in card
    assert "Running for under a minute: 1 of 4 invocations checked so far" in card

    restore_projection(invocation_id="inv-2", actor="user:ada", reason="found by the pass")
    card = compliance.get("/audit/verify/").content.decode().split("</section>")[0]
    assert (
        '<a href="/invocations/inv-2/">its page</a> (row restored under a minute ago by '
        "user:ada)</li>"
    ) in card


def test_the_pages_list_the_first_ten_breaks_and_count_the_rest(ledger: Api) -> None:
    finished = whole_pass(slice_size=10)
    breaks = [{"break": f"seal broken at seal {n}", "invocation_id": None} for n in range(12)]
    VerificationPass.objects.filter(pk=finished.pk).update(breaks=breaks, break_count=12)

    compliance = person("carol", "compliance")
    for page in ("/audit/verify/", "/dashboard/"):
        shown = compliance.get(page).content.decode()
        assert shown.count("<li><code>seal broken at seal") == 10, page
        assert "and 2 more: the <a" in shown, page


# The action log ------------------------------------------------------------------


def tokens_issued_and_revoked() -> list[AdminAction]:
    """Three actions, as administrators record them: two tokens issued, one revoked."""
    for name in ("runtime-x", "runtime-y"):
        call_command("create_runtime", name, stdout=io.StringIO(), stderr=io.StringIO())
    RuntimeToken.objects.get(runtime__name="runtime-x").revoke(actor="cli:ada", reason="left")
    return list(AdminAction.objects.order_by("id"))


def test_the_action_log_is_one_chain_in_the_order_recorded(db: None) -> None:
    actions = tokens_issued_and_revoked()
    assert [a.action for a in actions] == ["token_issued", "token_issued", "token_revoked"]
    prev = GENESIS_HASH
    for action in actions:
        assert action.prev_hash == prev
        assert action.hash == event_hash(prev, action.body())
        prev = action.hash
    report = verify()
    assert (report.ok, report.admin_actions) == (True, 3)
    assert whole_pass().admin_actions == 3


@pytest.mark.parametrize(
    ("tampering", "found"),
    [
        (
            "UPDATE ledger_adminaction SET reason = '' WHERE action = 'token_revoked'",
            "action broken at admin action {third}: expected hash ",
        ),
        (
            "DELETE FROM ledger_adminaction WHERE id = {second}",
            "action broken at admin action {third}: expected prev_hash {second_hash}, "
            "found prev_hash {second_hash_recorded}",
        ),
    ],
)
def test_an_action_rewritten_or_taken_out_is_found(db: None, tampering: str, found: str) -> None:
    first, second, third = tokens_issued_and_revoked()
    superuser_sql(tampering.format(second=second.pk))
    expected = found.format(
        third=third.pk, second_hash=first.hash, second_hash_recorded=second.hash
    )
    for breaks in ([str(b) for b in verify().breaks], said(whole_pass())):
        assert len(breaks) == 1 and breaks[0].startswith(expected), breaks


@pytest.mark.django_db(transaction=True)
def test_actions_recorded_at_once_on_many_connections_stay_one_chain() -> None:
    def record(n: int) -> None:
        try:
            AdminAction.record(actor="cli:ada", action="token_issued", target=f"token {n}")
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(record, range(16)))
    actions = list(AdminAction.objects.order_by("id"))
    assert len(actions) == 16
    assert [a.prev_hash for a in actions] == [GENESIS_HASH, *(a.hash for a in actions[:-1])]
    assert verify().ok


@pytest.mark.django_db(transaction=True)
def test_actions_recorded_before_the_chain_are_chained_by_the_migration() -> None:
    with at_migration("0028_verification_pass"), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO ledger_adminaction (actor, action, target, reason, created_at) "
            "VALUES ('cli:ada', 'token_issued', 'runtime a, token 1', '', now()), "
            "('cli:ada', 'token_revoked', 'runtime a, token 1', 'left', now())"
        )
    first, second = AdminAction.objects.order_by("id")
    assert (first.prev_hash, second.prev_hash) == (GENESIS_HASH, first.hash)
    assert second.hash == event_hash(first.hash, second.body())
    assert verify().ok
    with pytest.raises(ProgrammingError, match="append-only"):  # the trigger is back on
        AdminAction.objects.filter(pk=first.pk).update(reason="edited")


def test_an_actions_hash_is_logged_once_it_is_committed_and_never_if_not(
    db: None, caplog: pytest.LogCaptureFixture, django_capture_on_commit_callbacks: Any
) -> None:
    with caplog.at_level(logging.INFO, logger="ledger.models"):
        with pytest.raises(RuntimeError), transaction.atomic():
            AdminAction.record(actor="cli:ada", action="token_issued", target="token 1")
            raise RuntimeError("the command failed after recording it")
        with django_capture_on_commit_callbacks(execute=True):
            kept = AdminAction.record(actor="cli:ada", action="token_issued", target="token 2")
    assert [r.getMessage() for r in caplog.records] == [
        f"admin action id={kept.pk} action=token_issued hash={kept.hash}"
    ]
