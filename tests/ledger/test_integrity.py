"""Tamper evidence: each kind of tampering, done as a superuser would, is reported
exactly where it happened; an untouched ledger verifies clean."""

from __future__ import annotations

import datetime as dt
import io
import json
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core.cache import cache
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import IntegrityError, connection, transaction
from django.db.utils import ProgrammingError
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from ledger import chain, integrity, services
from ledger.anchors import anchor_newest
from ledger.capabilities import capability_settings_change
from ledger.integrity import merkle_root, seal_events, verify, verify_next_slice
from ledger.models import (
    AdminAction,
    Attempt,
    Capability,
    Event,
    Invocation,
    Outcome,
    RateAdmission,
    Runtime,
    Seal,
    SealedEvent,
)
from ledger.partitions import create_event_partitions, month_partition
from ledger.tasks import seal_new_events
from reconciliation import services as reconciliation_services
from reconciliation.sweeper import forget_spent_probe_jobs, sweep
from tests.conftest import ROOT, AnchorStore, Api, intent_body, person, registered
from tests.ledger.conftest import superuser_sql


def verify_command(*args: str) -> str:
    out = io.StringIO()
    call_command("verify_ledger", *args, stdout=out)
    return out.getvalue()


def one_break_reported(*args: str) -> tuple[str, str]:
    """What verify_ledger (failing, with one break) prints and what the Verify page shows."""
    out = io.StringIO()
    with pytest.raises(CommandError, match="1 broken link"):
        call_command("verify_ledger", *args, stdout=out)
    client = Client()
    client.force_login(User.objects.create_superuser("root"))
    page = client.get("/audit/verify/", {"run": "1"}).content.decode()
    return out.getvalue(), page


def event_id(invocation_id: str, seq: int) -> int:
    return Event.objects.get(invocation__invocation_id=invocation_id, seq=seq).pk


def test_an_untouched_ledger_verifies_clean(ledger: Api) -> None:
    report = verify(projections=True)
    assert report.ok, report.breaks
    assert (report.invocations, report.events, report.seals) == (4, 10, 1)
    output = verify_command("--projections")
    assert output.startswith("OK: 4 invocations, 10 events, 1 seal")
    seal = Seal.objects.get()
    assert f"newest seal: {seal.hash} (sequence 1-9)" in output


def test_an_altered_payload_is_found(ledger: Api) -> None:
    superuser_sql(
        "UPDATE ledger_event SET data = jsonb_set(data, '{business_reference}', '\"RF-X\"') "
        "WHERE id = %s",
        event_id("inv-2", 3),
    )
    breaks = verify().breaks
    assert [(b.what, b.where) for b in breaks] == [("chain", "invocation inv-2 event #3")]
    assert breaks[0].expected != breaks[0].found
    with pytest.raises(CommandError, match="1 broken link"):
        verify_command()


def test_a_deleted_event_is_found(ledger: Api) -> None:
    superuser_sql("DELETE FROM ledger_sealedevent WHERE event_id = %s", event_id("inv-1", 2))
    superuser_sql("DELETE FROM ledger_event WHERE id = %s", event_id("inv-1", 2))
    breaks = verify().breaks
    assert (breaks[0].what, breaks[0].where) == ("chain", "invocation inv-1 event #2")
    assert (breaks[0].expected, breaks[0].found) == ("seq 2", "seq 3")
    # The seal no longer covers what it sealed.
    assert [b.what for b in breaks[1:]] == ["seal"]


def test_two_reordered_events_are_found(ledger: Api) -> None:
    second, third = event_id("inv-3", 2), event_id("inv-3", 3)
    superuser_sql("UPDATE ledger_event SET seq = 0 WHERE id = %s", second)
    superuser_sql("UPDATE ledger_event SET seq = 2 WHERE id = %s", third)
    superuser_sql("UPDATE ledger_event SET seq = 3 WHERE id = %s", second)
    breaks = verify().breaks
    assert [(b.what, b.where) for b in breaks] == [("chain", "invocation inv-3 event #2")]


def test_a_changed_seal_is_found(ledger: Api) -> None:
    superuser_sql("UPDATE ledger_seal SET merkle_root = repeat('0', 64)")
    breaks = verify().breaks
    assert {(b.what, b.where.split(" (")[0]) for b in breaks} == {
        ("seal", f"seal {Seal.objects.get().pk}")
    }


def test_a_rewritten_projection_is_found(ledger: Api) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE ledger_invocation SET status = 'failed' WHERE invocation_id = 'inv-1'"
        )
    assert verify().ok  # the chains are intact…
    breaks = verify(projections=True).breaks
    assert [(b.where, b.expected, b.found) for b in breaks] == [
        ("invocation inv-1 status", "'succeeded'", "'failed'")
    ]
    output, page = one_break_reported("--projections")
    assert "manage.py restore_projection INVOCATION_ID" in output
    assert "projection broken at invocation inv-1 status" in page
    assert "manage.py restore_projection INVOCATION_ID" in page


def test_a_rewritten_attempt_in_flight_is_found(ledger: Api) -> None:
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5", attempt_id="a1")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE ledger_invocation SET in_flight_attempt = 'a9' WHERE invocation_id = 'inv-5'"
        )
    breaks = verify(projections=True).breaks
    assert [(b.where, b.expected, b.found) for b in breaks] == [
        ("invocation inv-5 in_flight_attempt", "'a1'", "'a9'")
    ]


def rewrite_with_hashes(invocation_id: str, seq: int, **state: object) -> None:
    """The last event's recorded state rewritten and its hash recomputed, with the row's
    head to match: every hash checks out."""
    event = Event.objects.get(invocation__invocation_id=invocation_id, seq=seq)
    assert event.seq == Invocation.objects.get(invocation_id=invocation_id).event_count
    event.data["state"].update(state)
    event.hash = chain.event_hash(event.prev_hash, services.event_body(event, invocation_id))
    superuser_sql(
        "UPDATE ledger_event SET data = %s::jsonb, hash = %s WHERE id = %s",
        json.dumps(event.data),
        event.hash,
        event.pk,
    )
    Invocation.objects.filter(invocation_id=invocation_id).update(head_hash=event.hash)


@pytest.mark.rewrites_history
def test_a_history_rewritten_with_its_hashes_recomputed_is_found_by_replay(ledger: Api) -> None:
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5", attempt_id="a1")
    status, body = ledger.outcome("inv-5", "a1", kind="post_dispatch_evidence_failed")
    assert (status, body["status"]) == (201, "reconciliation_required")
    assert verify(projections=True).ok
    # A refund whose evidence was lost, edited to invite a second one.
    rewrite_with_hashes("inv-5", 3, status="retry_allowed", cause=None)
    Invocation.objects.filter(invocation_id="inv-5").update(status="retry_allowed", cause="")
    breaks = verify(projections=True).breaks
    assert [(b.what, b.where) for b in breaks] == [("transition", "invocation inv-5 event #3")]
    assert breaks[0].expected == (
        "a step of the retry policy from status in_flight, attempts 1, in_flight_attempt a1"
    )
    assert breaks[0].found == (
        "outcome_recorded recording status retry_allowed, "
        "failure_class post_dispatch_evidence_failed, attempts 1"
    )
    output, page = one_break_reported()
    assert "transition broken at invocation inv-5 event #3" in output
    assert "restore_projection does not repair it" in output
    assert "transition broken at invocation inv-5 event #3" in page
    assert "restore_projection does not repair it" in page


@pytest.mark.rewrites_history
def test_a_flag_added_by_an_event_that_never_sets_it_is_found(ledger: Api) -> None:
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5", attempt_id="a1")
    # An admission cannot find the capability undeclared: only its intent can.
    rewrite_with_hashes("inv-5", 2, flags=["undeclared"])
    breaks = verify().breaks
    assert [(b.what, b.where) for b in breaks] == [("transition", "invocation inv-5 event #2")]
    assert breaks[0].found == (
        "attempt_admitted recording status in_flight, attempts 1, in_flight_attempt a1, "
        "flags undeclared"
    )


@pytest.mark.rewrites_history
@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("status", "refunded", "'status': 'refunded'"),
        ("attempt_count", "0", "'attempt_count': '0'"),
        ("in_flight_attempt", ["a1"], "'in_flight_attempt': ['a1']"),
        ("flags", "undeclared", "'flags': 'undeclared'"),
    ],
)
def test_a_recorded_state_that_is_no_state_is_found(
    ledger: Api, field: str, value: object, shown: str
) -> None:
    rewrite_with_hashes("inv-4", 1, **{field: value})
    breaks = verify().breaks
    assert [(b.what, b.where, b.expected) for b in breaks] == [
        ("transition", "invocation inv-4 event #1", "a state of the retry policy")
    ]
    assert shown in breaks[0].found


def restore_command(*ids: str, by: str = "ada", reason: str = "INC-7: row edited by hand") -> str:
    out = io.StringIO()
    call_command("restore_projection", *ids, "--by", by, "--reason", reason, stdout=out)
    return out.getvalue()


def as_ada() -> Client:
    client = Client()
    client.force_login(User.objects.get(username="ada"))
    return client


def break_row_after_lost_evidence(ledger: Api) -> None:
    """inv-5: a refund whose outcome was lost, its row edited to invite a second one."""
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5", attempt_id="a1")
    ledger.outcome("inv-5", "a1", kind="post_dispatch_evidence_failed")
    Invocation.objects.filter(invocation_id="inv-5").update(status="retry_allowed", cause="")


@pytest.fixture
def ada(db: None) -> None:
    User.objects.create_user("ada").groups.add(Group.objects.get_or_create(name="admin")[0])


def test_a_rewritten_projection_is_restored_from_its_events_on_the_record(
    ledger: Api, ada: None
) -> None:
    """A row edited to let a refund whose outcome was lost be retried is put back to
    what its events say, and its chain says who did that and why."""
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5", attempt_id="a1")
    services.flag_missing_evidence(invocation_id="inv-5", now=timezone.now() + dt.timedelta(days=1))
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE ledger_invocation SET status = 'retry_allowed', failure_class = "
            "'pre_dispatch_rejected', cause = '', event_count = 2, head_hash = repeat('0', 64) "
            "WHERE invocation_id = 'inv-5'"
        )
    # Its typed state would say retryable, which no event says: refused, as writes are.
    status, body = ledger.get("/api/v1/invocations/inv-5")
    assert (status, body["error"]["type"]) == (500, "projection_broken")
    assert "inv-5: failure_class, in_flight_attempt, status, head_hash" in body["error"]["message"]
    status, body = ledger.get("/api/v1/invocations")
    assert (status, body["error"]["details"]) == (500, {"invocation_ids": ["inv-5"]})
    assert [b.where for b in verify(projections=True).breaks] == [
        "invocation inv-5 head",
        "invocation inv-5 status",
        "invocation inv-5 failure_class",
        "invocation inv-5 cause",
    ]

    output = restore_command("inv-5", "inv-1")

    assert "inv-5: restored status 'retry_allowed' -> 'reconciliation_required', " in output
    assert "inv-1: agrees with its events; nothing written" in output
    assert verify(projections=True).ok
    status, listed = ledger.get("/api/v1/invocations")
    assert (status, [row["invocation_id"] for row in listed["results"]]) == (
        200,
        ["inv-1", "inv-2", "inv-3", "inv-4", "inv-5"],
    )
    _, body = ledger.get("/api/v1/invocations/inv-5")
    assert (body["status"], body["failure_class"], body["retryable"]) == (
        "reconciliation_required",
        "post_dispatch_evidence_failed",
        False,
    )
    assert ledger.attempt("inv-5", "a2")[1]["error"]["type"] == "attempt_refused"
    restoring = Event.objects.get(invocation__invocation_id="inv-5", kind="projection_restored")
    assert (restoring.seq, restoring.actor) == (4, "user:ada")
    assert restoring.data["reason"] == "INC-7: row edited by hand"
    assert restoring.data["restored"]["status"] == {
        "found": "retry_allowed",
        "recorded": "reconciliation_required",
    }
    assert restoring.data["restored"]["head"]["found"] == [2, "0" * 64]
    assert Event.objects.filter(kind="projection_restored").count() == 1  # not for inv-1
    action_log = as_ada().get("/audit/actions/").content.decode()
    assert "projection_restored" in action_log and "INC-7: row edited by hand" in action_log


def test_a_row_edited_where_its_intent_fixed_it_is_refused_and_restored(
    ledger: Api, ada: None
) -> None:
    """A refund's row edited to say its capability is read-only would make its lost
    evidence retryable (a second refund), and a lower risk would spare it the second
    person. Both come from the intent's event, which says otherwise."""
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5", attempt_id="a1")
    risk = Invocation.objects.get(invocation_id="inv-5").risk_level
    assert risk != "low"
    Invocation.objects.filter(invocation_id="inv-5").update(hint_readonly=True, risk_level="low")
    events = Event.objects.filter(invocation__invocation_id="inv-5")
    written = list(events.values_list("seq", "hash"))

    status, body = ledger.outcome("inv-5", "a1", kind="post_dispatch_evidence_failed")
    assert (status, body["error"]["type"]) == (500, "projection_broken")
    assert "(inv-5: hint_readonly, risk_level)" in body["error"]["message"]
    assert list(events.values_list("seq", "hash")) == written
    assert ledger.get("/api/v1/invocations/inv-5")[1]["error"]["type"] == "projection_broken"
    assert [(b.where, b.expected, b.found) for b in verify(projections=True).breaks] == [
        ("invocation inv-5 hint_readonly", "False", "True"),
        ("invocation inv-5 risk_level", repr(risk), "'low'"),
    ]

    output = restore_command("inv-5")

    assert "restored hint_readonly True -> False" in output
    assert verify(projections=True).ok
    row = Invocation.objects.get(invocation_id="inv-5")
    assert (row.hint_readonly, row.risk_level) == (False, risk)
    status, body = ledger.outcome("inv-5", "a1", kind="post_dispatch_evidence_failed")
    assert (status, body["status"], body["retryable"]) == (201, "reconciliation_required", False)


def test_a_row_handed_to_another_runtime_is_refused_to_it_and_restored(
    ledger: Api, api_b: Api, runtime_a: Runtime, runtime_b: Runtime, ada: None
) -> None:
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5", attempt_id="a1")
    Invocation.objects.filter(invocation_id="inv-5").update(runtime=runtime_b)
    events = Event.objects.filter(invocation__invocation_id="inv-5")
    written = list(events.values_list("seq", "hash"))

    # Runtime B neither settles it, nor reads it, nor lists it: A recorded the intent.
    status, body = api_b.outcome("inv-5", "a1", kind="succeeded", business_reference="RF-5")
    assert (status, body["error"]["type"]) == (500, "projection_broken")
    assert "(inv-5: runtime)" in body["error"]["message"]
    assert list(events.values_list("seq", "hash")) == written
    assert api_b.get("/api/v1/invocations/inv-5")[1]["error"]["type"] == "projection_broken"
    assert api_b.get("/api/v1/invocations")[1]["error"]["details"] == {"invocation_ids": ["inv-5"]}
    assert [(b.where, b.expected, b.found) for b in verify(projections=True).breaks] == [
        ("invocation inv-5 runtime", repr(f"runtime:{runtime_a.name}"),
         repr(f"runtime:{runtime_b.name}")),
    ]  # fmt: skip

    restore_command("inv-5")

    assert Invocation.objects.get(invocation_id="inv-5").runtime_id == runtime_a.pk
    assert verify(projections=True).ok
    assert api_b.get("/api/v1/invocations/inv-5")[0] == 404
    status, body = ledger.outcome("inv-5", "a1", kind="succeeded", business_reference="RF-5")
    assert (status, body["status"]) == (201, "succeeded")


def test_evidence_for_a_row_counting_fewer_events_is_refused_typed_until_restored(
    ledger: Api, ada: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Its next event would take a number already taken: refused, naming the
    invocation and the remedy, and nothing is written until the row is put back. The
    row here agrees with the event it counts as its last (its first), so only the
    write finds it out."""
    ledger.intent(invocation_id="inv-5", idempotency_key="k-5", attempt_id="a1")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE ledger_invocation SET event_count = 1, status = 'recorded', "
            "attempt_count = 0, in_flight_attempt = '', head_hash = e.hash "
            "FROM ledger_event e WHERE e.invocation_id = ledger_invocation.id AND e.seq = 1 "
            "AND ledger_invocation.invocation_id = 'inv-5'"
        )
    events = Event.objects.filter(invocation__invocation_id="inv-5")
    written = list(events.values_list("seq", "hash"))

    status, body = ledger.outcome("inv-5", "a1", kind="succeeded", business_reference="RF-5")
    assert status == 500
    assert (body["error"]["type"], body["error"]["details"]) == (
        "projection_broken",
        {"invocation_ids": ["inv-5"]},
    )
    assert "inv-5 counts fewer events than it has" in body["error"]["message"]
    assert "manage.py restore_projection" in body["error"]["message"]
    assert "projection broken invocations=inv-5: counts fewer events" in caplog.text
    batch_status, batch = ledger.post(
        "/api/v1/evidence",
        [{"type": "intent", **intent_body(invocation_id="inv-6", idempotency_key="k-6")},
         {"type": "outcome", "invocation_id": "inv-5", "attempt_id": "a1", "kind": "succeeded"}],
    )  # fmt: skip
    assert (batch_status, batch["error"]["type"]) == (500, "projection_broken")
    assert list(events.values_list("seq", "hash")) == written
    assert not Outcome.objects.filter(attempt__invocation__invocation_id="inv-5").exists()
    assert not Invocation.objects.filter(invocation_id="inv-6").exists()

    restore_command("inv-5")
    status, body = ledger.outcome("inv-5", "a1", kind="succeeded", business_reference="RF-5")
    assert (status, body["status"]) == (201, "succeeded")
    assert verify(projections=True).ok


def test_evidence_for_a_row_its_events_do_not_explain_is_refused_typed(
    ledger: Api, ada: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A refund whose outcome was lost, its row edited to invite a second one: the
    write reads the event the row counts as its last, and admits nothing."""
    break_row_after_lost_evidence(ledger)
    events = Event.objects.filter(invocation__invocation_id="inv-5")
    written = list(events.values_list("seq", "hash"))

    status, body = ledger.attempt("inv-5", "a2")
    assert (status, body["error"]["type"], body["error"]["details"]) == (
        500,
        "projection_broken",
        {"invocation_ids": ["inv-5"]},
    )
    assert "no longer agrees with its events (inv-5: cause, status)" in body["error"]["message"]
    assert "projection broken invocations=inv-5: no longer agrees" in caplog.text
    assert list(events.values_list("seq", "hash")) == written
    assert not Attempt.objects.filter(attempt_id="a2").exists()
    # The console's and the probes' writes are refused alike, and the console says so.
    with pytest.raises(services.LedgerError, match="inv-5: cause, status"):
        reconciliation_services.invocation_claim(invocation_id="inv-5", worker="w")
    console = as_ada()
    page = console.get(reverse("console:invocation", args=["inv-5"])).content.decode()
    assert "This record no longer agrees with its events (cause, status)" in page

    restore_command("inv-5")
    page = console.get(reverse("console:invocation", args=["inv-5"])).content.decode()
    assert "no longer agrees" not in page
    assert ledger.attempt("inv-5", "a2")[1]["error"]["type"] == "attempt_refused"
    # Its head alone edited: the next event would be chained to a hash not the chain's.
    Invocation.objects.filter(invocation_id="inv-5").update(head_hash="0" * 64)
    status, body = ledger.outcome("inv-5", "a1", kind="succeeded", business_reference="RF-5")
    assert (status, body["error"]["type"]) == (500, "projection_broken")
    assert "(inv-5: head_hash)" in body["error"]["message"]
    assert list(events.values_list("seq", "hash"))[-1][0] == 4  # the restoring, no more
    assert verify().breaks[0].where == "invocation inv-5 head"


def test_a_projection_is_not_restored_from_a_broken_chain(ledger: Api, ada: None) -> None:
    superuser_sql(
        "UPDATE ledger_event SET data = jsonb_set(data, '{state,status}', '\"failed\"') "
        "WHERE id = %s",
        event_id("inv-2", 3),
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE ledger_invocation SET status = 'failed' WHERE invocation_id = 'inv-2'"
        )
    superuser_sql("DELETE FROM ledger_event WHERE id = %s", event_id("inv-4", 1))
    err = io.StringIO()
    with pytest.raises(CommandError, match="2 of 2 not restored"):
        call_command(
            "restore_projection", "inv-2", "inv-4", "--by", "ada", "--reason", "x", stderr=err
        )
    assert "inv-2: not restored: chain broken at invocation inv-2 event #3" in err.getvalue()
    assert "inv-4: not restored: invocation inv-4: it has no events." in err.getvalue()
    assert not Event.objects.filter(kind="projection_restored").exists()


def test_an_admin_restores_a_broken_row_from_its_page_on_the_record(ledger: Api, ada: None) -> None:
    break_row_after_lost_evidence(ledger)
    page_url = reverse("console:invocation", args=["inv-5"])
    restore_url = reverse("console:restore", args=["inv-5"])
    admin = as_ada()
    assert "Restore from its events" in admin.get(page_url).content.decode()
    # Others read that it is broken, and cannot restore it.
    for role in ("operator", "approver", "compliance"):
        other = person(f"{role}-1", role)
        page = other.get(page_url).content.decode()
        assert "no longer agrees with its events (cause, status)" in page
        assert "Restore from its events" not in page
        assert other.post(restore_url, {"reason": "mine"}).status_code == 403, role
    # A reason is required.
    response = admin.post(restore_url, {"reason": "  "})
    assert response.status_code == 400
    assert "This field is required." in response.content.decode()
    assert not Event.objects.filter(kind="projection_restored").exists()

    response = admin.post(restore_url, {"reason": "INC-9: status edited by hand"})

    assert (response.status_code, response["Location"]) == (303, page_url)
    page = admin.get(page_url).content.decode()
    assert page.count("Restored from its events: cause, status.") == 1
    assert "no longer agrees" not in page
    restoring = Event.objects.get(kind="projection_restored")
    assert (restoring.actor, restoring.data["reason"]) == (
        "user:ada",
        "INC-9: status edited by hand",
    )
    assert restoring.data["restored"]["status"] == {
        "found": "retry_allowed",
        "recorded": "reconciliation_required",
    }
    assert ledger.attempt("inv-5", "a2")[1]["error"]["type"] == "attempt_refused"
    assert verify(projections=True).ok
    # Sent again (a second admin's stale page, in place with htmx): nothing more written.
    response = admin.post(restore_url, {"reason": "again"}, headers={"HX-Request": "true"})
    assert response.status_code == 200
    assert "It agrees with its events already; nothing was written." in response.content.decode()
    assert Event.objects.filter(kind="projection_restored").count() == 1


def test_the_page_does_not_restore_a_row_from_a_broken_chain(ledger: Api, ada: None) -> None:
    superuser_sql(
        "UPDATE ledger_event SET data = jsonb_set(data, '{state,status}', '\"failed\"') "
        "WHERE id = %s",
        event_id("inv-2", 3),
    )
    Invocation.objects.filter(invocation_id="inv-2").update(status="failed")
    admin = as_ada()

    response = admin.post(reverse("console:restore", args=["inv-2"]), {"reason": "x"})

    assert response.status_code == 303
    page = admin.get(reverse("console:invocation", args=["inv-2"])).content.decode()
    assert "chain broken at invocation inv-2 event #3" in page
    assert "The row was not restored from a broken chain." in page
    assert not Event.objects.filter(kind="projection_restored").exists()
    assert (
        admin.post(reverse("console:restore", args=["inv-9"]), {"reason": "x"}).status_code == 404
    )


def test_only_an_admin_named_with_a_reason_restores(ledger: Api, ada: None) -> None:
    User.objects.create_user("olga")
    with pytest.raises(CommandError, match="'olga' is not an active console user"):
        restore_command("inv-1", by="olga")
    with pytest.raises(CommandError, match="--reason must say why"):
        restore_command("inv-1", reason="  ")
    assert not Event.objects.filter(kind="projection_restored").exists()


def test_seals_number_events_contiguously_and_chain(ledger: Api) -> None:
    first = Seal.objects.get()
    assert (first.first_sequence, first.last_sequence, first.prev_hash) == (1, 9, "0" * 64)
    second = seal_events()
    assert second is not None
    assert (second.first_sequence, second.last_sequence) == (10, 10)
    assert second.prev_hash == first.hash
    assert seal_events() is None  # nothing new
    hashes = SealedEvent.objects.filter(seal=first).order_by("sequence")
    assert first.merkle_root == merkle_root(hashes.values_list("event__hash", flat=True))


def test_an_event_from_a_host_whose_clock_is_behind_is_sealed_all_the_same(
    ledger: Api,
) -> None:
    """A web host whose clock runs 20 minutes slow stamps its events before the last
    seal's lookback; they are committed now, so the next seal must still take them."""
    assert seal_events() is not None  # inv-4's intent: the newest seal is now
    slow = timezone.now() - dt.timedelta(minutes=20)
    noted = services.invocation_transition(
        invocation_id="inv-4", actor="user:olga", kind="assigned",
        change=lambda invocation: {"assignee": "olga"}, now=slow,
    )  # fmt: skip
    assert noted is not None
    late = Event.objects.get(invocation__invocation_id="inv-4", seq=2)
    assert late.created_at == slow
    seal = seal_events()
    assert seal is not None and seal.event_count == 1
    assert SealedEvent.objects.get(event=late).seal == seal
    assert verify().ok


def test_a_second_seal_over_the_same_sequence_is_refused(ledger: Api) -> None:
    first = Seal.objects.get()
    rival = Seal(
        first_sequence=first.first_sequence, last_sequence=first.last_sequence,
        event_count=first.event_count, merkle_root=first.merkle_root,
        prev_hash=first.prev_hash, hash="f" * 64,
    )  # fmt: skip
    with pytest.raises(IntegrityError, match="seal_last_sequence_unique"), transaction.atomic():
        rival.save()


def test_merkle_roots_commit_to_order_and_content() -> None:
    leaves = [chain.digest(n).removeprefix("sha256:") for n in range(5)]
    assert merkle_root(leaves) != merkle_root(leaves[::-1])
    assert merkle_root(leaves) != merkle_root(leaves[:4])
    assert merkle_root(leaves[:1]) == leaves[0]


def readme_role_statements(role: str) -> list[str]:
    """The README's statements that make the application's role, made for `role`."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Database roles")[1].split("```sql\n")[1].split("```")[0]
    block = block.replace("ledger_app", role).replace("LOGIN PASSWORD '…'", "NOLOGIN")
    return [statement.strip() for statement in block.split(";\n") if statement.strip()]


def test_the_readmes_application_role_runs_the_ledger_and_cannot_rewrite_evidence(
    ledger: Api, anchor_store: AnchorStore, settings: Any
) -> None:
    """Every kind of write the web processes and workers make, as the role the README
    tells a deployment to run them as; and what that role must never do."""
    with connection.cursor() as cursor:
        for statement in readme_role_statements("ledger_app_test"):
            cursor.execute(statement)
        # Undone with the test's transaction, whatever happens in it.
        cursor.execute("SET ROLE ledger_app_test")
        ledger.intent(invocation_id="inv-9", idempotency_key="k-9", attempt_id="a1")
        ledger.outcome("inv-9", "a1", kind="post_dispatch_evidence_failed")
        ledger.intent(invocation_id="inv-10", idempotency_key="k-10", attempt_id="a1")
        Invocation.objects.filter(invocation_id="inv-10").update(deadline_at=timezone.now())
        assert sweep() == 1
        forget_spent_probe_jobs()  # a DELETE
        assert seal_events() is not None
        for _ in range(2):  # the second pass forgets old clean ones: a DELETE
            assert verify_next_slice(invocations=100) is not None
        AdminAction.record(actor="cli:ada", action="token_issued", target="runtime a")
        registered("refund.create", risk_level="medium")  # a new version of it
        capability_settings_change(
            scope="refund.create", actor="user:ada", reason="the role's check", max_attempts=2
        )
        assert verify().ok
        # An enforced rate limit: the admissions already made in its window numbered
        # (five: inv-1, 2, 3, 9 and 10), its lock, its count, its row kept.
        registered("refund.create", rate_limit={"count": 10, "window": "1m"})
        capability_settings_change(
            scope="refund.create", actor="user:ada", reason="the role's check",
            rate_limit_enforced=True,
        )  # fmt: skip
        assert (
            ledger.intent(invocation_id="inv-11", idempotency_key="k-11", attempt_id="a1")[0] == 201
        )
        assert RateAdmission.objects.count() == 6
        settings.LEDGER_ANCHOR_URL = anchor_store.url
        assert anchor_newest() is not None
        cache.set("role-check", 1)
        cache.delete("role-check")
        # Beat's partitions, which only the owner of the event table can make.
        made = create_event_partitions(months_ahead=4)
        assert len(made) == 1
        cursor.execute("SELECT tableowner FROM pg_tables WHERE tablename = %s", made)
        assert cursor.fetchone()[0] != "ledger_app_test"
        operator = person("olga", "operator")
        assert operator.get("/").status_code == 200
        operator.logout()  # its session row is deleted
        for statement in (
            "UPDATE ledger_event SET kind = kind",
            "DELETE FROM ledger_seal",
            "UPDATE ledger_anchor SET receipt = ''",
            "UPDATE ledger_adminaction SET actor = actor",
            "DELETE FROM ledger_capabilitydeclaration",
            "DELETE FROM ledger_invocation",
            "TRUNCATE ledger_event",
            "DELETE FROM ledger_event_default",  # a partition: not even to its trigger
            f"UPDATE {month_partition(timezone.now())} SET kind = kind",
        ):
            cursor.execute("SAVEPOINT attempt")
            with pytest.raises(ProgrammingError, match="permission denied"):
                cursor.execute(statement)
            cursor.execute("ROLLBACK TO SAVEPOINT attempt")
        cursor.execute("RESET ROLE")


def test_the_verify_page_names_the_first_broken_link(ledger: Api) -> None:
    reviewer = User.objects.create_user("cora", password="pw")
    reviewer.groups.add(Group.objects.get_or_create(name="compliance")[0])
    client = Client()
    client.force_login(reviewer)
    clean = client.get("/audit/verify/", {"run": "1"}).content.decode()
    assert (
        "OK: 4 invocations, 10 events, 1 seal, 4 projections, 1 admin action and "
        "1 capability verified." in clean
    )
    assert f"Newest seal verified: <code>{Seal.objects.get().hash}</code>" in clean
    with override_settings(LEDGER_VERIFY_PAGE_MAX_EVENTS=9):
        too_many = client.get("/audit/verify/", {"run": "1"}).content.decode()
        assert "More than 9 events in this range" in too_many and "verified." not in too_many
        since = Event.objects.get(invocation__invocation_id="inv-4").created_at
        narrowed = client.get("/audit/verify/", {"run": "1", "since": since.isoformat()})
        assert "OK: 1 invocation, 1 event, 0 seals" in narrowed.content.decode()
    mistyped = client.get("/audit/verify/", {"run": "1", "since": "yesterday"}).content.decode()
    assert "since: Enter a valid date/time." in mistyped
    assert "verified." not in mistyped  # not the whole ledger instead of the range
    superuser_sql(
        "UPDATE ledger_event SET actor = 'runtime:forged' WHERE id = %s", event_id("inv-2", 2)
    )
    broken = client.get("/audit/verify/", {"run": "1"}).content.decode()
    assert "chain broken at invocation inv-2 event #2" in broken


def test_beats_seal_task_seals_until_it_has_caught_up(
    api: Api, refund: Capability, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full seal means more events wait: the same run seals them, rather than leaving
    a busy ledger one more seal behind at every interval."""
    monkeypatch.setattr(integrity, "SEAL_BATCH", 2)
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    api.intent(invocation_id="inv-3", idempotency_key="k-3")
    assert seal_new_events.run() == 5
    assert list(Seal.objects.order_by("last_sequence").values_list("event_count", flat=True)) == [
        2,
        2,
        1,
    ]
    assert seal_new_events.run() == 0


def test_beats_seal_task_catches_up_for_its_time_and_the_next_run_goes_on(
    api: Api, refund: Capability, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """A run seals a full seal, then stops once LEDGER_CATCH_UP_SECONDS have passed
    (here at once): a backlog of millions of events is sealed over several runs,
    none holding its worker for minutes."""
    monkeypatch.setattr(integrity, "SEAL_BATCH", 2)
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    settings.LEDGER_CATCH_UP_SECONDS = 0
    assert [seal_new_events.run() for _ in range(3)] == [2, 2, 0]
