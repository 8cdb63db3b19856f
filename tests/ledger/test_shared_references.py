"""The reference watch: an invocation whose business reference a later invocation's
evidence names too is flagged, once, from the sealed events."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, transaction

from ledger import shared_references
from ledger.integrity import restore_projection, seal_events, verify
from ledger.models import Capability, Event, Invocation, ReferenceWatch
from ledger.shared_references import sealed_sharing, unflagged_namers, watch_shared_references
from ledger.tasks import watch_shared_references as beats_task
from tests.conftest import ROOT, Api, person, process_env, wait_for
from tests.ledger.conftest import killed_while_it_waits_on_a_row, superuser_sql
from tests.ledger.test_audit import copies_of_index
from tests.ledger.test_bundle import verify as verify_bundle
from tests.ledger.test_faults import admin_conninfo

FLAG = "reference_shared"


def settle(api: Api, name: str, reference: str, kind: str = "succeeded") -> None:
    status, body = api.intent(invocation_id=name, idempotency_key=name, attempt_id="a1")
    assert status == 201, body
    status, body = api.outcome(name, "a1", kind=kind, business_reference=reference)
    assert status == 201, body


def settle_all(api: Api, *references: str) -> None:
    """inv-1, inv-2, ... each succeed naming the reference in that place."""
    for n, reference in enumerate(references, start=1):
        settle(api, f"inv-{n}", reference)


def flagged() -> list[str]:
    rows = Invocation.objects.filter(flags__contains=[FLAG]).order_by("invocation_id")
    return list(rows.values_list("invocation_id", flat=True))


def told(invocation_id: str) -> list[Event]:
    return list(Event.objects.filter(invocation__invocation_id=invocation_id, kind=FLAG))


def test_the_earlier_namer_is_flagged_once_the_later_ones_evidence_is_sealed(
    api: Api, refund: Capability
) -> None:
    settle_all(api, "RF-1", "RF-1")
    assert flagged() == ["inv-2"]  # by its own outcome, as it was recorded
    assert watch_shared_references().flagged == []  # nothing sealed yet

    seal_events()
    watched = watch_shared_references()

    assert (watched.shared, watched.flagged, watched.caught_up) == (1, ["inv-1"], True)
    assert flagged() == ["inv-1", "inv-2"]
    (event,) = told("inv-1")
    assert (event.actor, event.seq) == ("ledger:reference_watch", 4)
    assert event.data["named_later"] == [{"business_reference": "RF-1", "also_named_by": ["inv-2"]}]
    status, body = api.get("/api/v1/invocations/inv-1")
    assert (status, body["status"], body["flags"]) == (200, "succeeded", [FLAG])
    # Read once: the next run, and one after the flag's own event is sealed, add nothing.
    assert watch_shared_references().flagged == []
    seal_events()
    assert watch_shared_references().flagged == []
    assert len(told("inv-1")) == 1 and told("inv-2") == []
    # The flag is a step the retry policy explains, and the row agrees with its events.
    assert verify(projections=True).ok


def test_an_evidence_bundle_with_the_flag_verifies_offline(
    api: Api, refund: Capability, tmp_path: Path
) -> None:
    """The standalone verifier replays the flag's event through the retry policy too."""
    settle_all(api, "RF-1", "RF-1")
    seal_events()
    watch_shared_references()
    seal_events()
    folder = tmp_path / "bundle"

    call_command("export_bundle", str(folder), invocation="inv-1")

    result = verify_bundle(folder)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "OK: 4 events and 2 seals verified"
    lines = (folder / "events.jsonl").read_text().splitlines()
    kinds = [json.loads(json.loads(line)["body"])["kind"] for line in lines]
    assert kinds[-1] == "reference_shared"


def test_another_runtimes_later_invocation_is_counted_and_never_named(
    api: Api, api_b: Api, refund: Capability
) -> None:
    settle(api, "a-refund-for-order-17", "RF-1")
    settle(api_b, "b-refund-for-order-17", "RF-1")
    seal_events()

    assert watch_shared_references().flagged == ["a-refund-for-order-17"]

    status, detail = api.get("/api/v1/invocations/a-refund-for-order-17")
    assert (status, detail["flags"]) == (200, [FLAG])
    (event,) = [e for e in detail["events"] if e["kind"] == FLAG]
    assert event["data"]["named_later"] == [
        {"business_reference": "RF-1", "also_named_elsewhere": 1}
    ]
    assert "b-refund" not in json.dumps(detail)
    page = person("cora", "compliance").get("/invocations/a-refund-for-order-17/")
    assert "(RF-1 named later by 1 invocation of other runtimes)" in page.content.decode()


def test_each_earlier_namer_is_told_once_however_many_name_it_later(
    api: Api, refund: Capability
) -> None:
    """A rejection naming the reference is a namer too: the later successes counted it."""
    settle(api, "inv-1", "RF-1")
    settle(api, "inv-2", "RF-1", kind="business_failed")
    settle(api, "inv-3", "RF-1")
    settle(api, "inv-4", "RF-2")  # its own reference: never flagged
    seal_events()
    assert watch_shared_references().flagged == ["inv-1", "inv-2"]
    settle(api, "inv-5", "RF-1")
    seal_events()

    assert watch_shared_references().flagged == []  # each is flagged already

    assert flagged() == ["inv-1", "inv-2", "inv-3", "inv-5"]
    assert [len(told(f"inv-{n}")) for n in range(1, 6)] == [1, 1, 0, 0, 0]
    assert told("inv-1")[0].data["named_later"] == [
        {"business_reference": "RF-1", "also_named_by": ["inv-3"]}
    ]


def test_a_namer_flagged_after_it_was_read_is_neither_flagged_again_nor_counted(
    api: Api, refund: Capability, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As if inv-2's own evidence had flagged it between the watch's read and its
    write: the write reads the row again and leaves it."""
    settle_all(api, "RF-1", "RF-1", "RF-1")
    seal_events()
    namers = Event.objects.filter(data__business_reference="RF-1").values_list(
        "data__business_reference", "invocation__invocation_id"
    )
    monkeypatch.setattr(shared_references, "unflagged_namers", lambda references: namers)

    assert watch_shared_references().flagged == ["inv-1"]

    assert told("inv-2") == [] and len(told("inv-1")) == 1
    assert told("inv-1")[0].data["named_later"] == [
        {"business_reference": "RF-1", "also_named_by": ["inv-2", "inv-3"]}
    ]


def test_a_run_that_reads_a_full_batch_leaves_the_rest_to_the_next(
    api: Api, refund: Capability
) -> None:
    settle_all(api, "RF-1", "RF-1", "RF-3", "RF-3")
    seal_events()
    sealed = Event.objects.count()
    events_of_inv_2 = [
        e.sealed.sequence for e in Event.objects.filter(invocation__invocation_id="inv-2")
    ]

    first = watch_shared_references(batch=max(events_of_inv_2))

    assert (first.flagged, first.caught_up) == (["inv-1"], False)
    assert ReferenceWatch.objects.get().through_sequence == max(events_of_inv_2)
    second = watch_shared_references()
    assert (second.flagged, second.caught_up) == (["inv-3"], True)
    assert ReferenceWatch.objects.get().through_sequence == sealed


def test_beats_task_reads_until_it_has_caught_up(
    api: Api, refund: Capability, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ledger.shared_references.BATCH", 2)
    settle_all(api, "RF-1", "RF-1", "RF-3", "RF-3")
    seal_events()

    assert beats_task() == 2

    assert flagged() == ["inv-1", "inv-2", "inv-3", "inv-4"]
    assert ReferenceWatch.objects.get().through_sequence == Event.objects.count() - 2


def test_a_flag_on_a_row_changed_outside_the_ledger_waits_until_it_is_restored(
    api: Api, refund: Capability, caplog: pytest.LogCaptureFixture
) -> None:
    settle_all(api, "RF-1", "RF-2", "RF-1", "RF-2")
    seal_events()
    superuser_sql(
        "UPDATE ledger_invocation SET flags = '{undeclared}' WHERE invocation_id = 'inv-1'"
    )

    with caplog.at_level(logging.ERROR, logger="ledger.shared_references"):
        watched = watch_shared_references()

    assert (watched.flagged, watched.unrecorded) == (["inv-2"], 1)
    assert "reference watch could not flag invocation=inv-1 error=projection_broken" in caplog.text
    assert ReferenceWatch.objects.get().unrecorded == [
        {"invocation_id": "inv-1", "business_reference": "RF-1", "named_later_by": "inv-3",
         "runtime_id": Invocation.objects.get(invocation_id="inv-3").runtime_id}
    ]  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="ledger.shared_references"):
        assert watch_shared_references().unrecorded == 1  # still refused, not logged again
    assert "reference watch" not in caplog.text
    restore_projection(invocation_id="inv-1", actor="user:ada", reason="reference watch test")

    watched = watch_shared_references()

    assert (watched.flagged, watched.unrecorded) == (["inv-1"], 0)
    assert told("inv-1")[0].data["named_later"][0]["also_named_by"] == ["inv-3"]


def test_compliance_finds_the_earlier_namer_by_the_flag(api: Api, refund: Capability) -> None:
    settle_all(api, "RF-1", "RF-1")
    seal_events()
    reviewer = person("cora", "compliance")
    assert "inv-1" not in reviewer.get("/audit/", {"flag": FLAG}).content.decode()

    watch_shared_references()

    found = reviewer.get("/audit/", {"flag": FLAG}).content.decode()
    assert "inv-1" in found and "inv-2" in found
    page = reviewer.get("/invocations/inv-1/").content.decode()
    assert "<strong>reference_shared</strong> by ledger:reference_watch" in page
    assert "(RF-1 named later by inv-2)" in page


@pytest.mark.django_db(transaction=True)
def test_a_watch_killed_halfway_records_nothing_and_the_next_run_reads_it_again(
    api: Api, refund: Capability
) -> None:
    """A watch in its own process, flagging one invocation per write, killed with
    SIGKILL while its second flag waits on a row lock: its cursor and its flags are one
    transaction, so none is kept, and the next run flags each invocation once."""
    watch_shared_references()  # the watch's row, whose cursor the killed run must not move
    settle_all(api, "RF-1", "RF-2", "RF-1", "RF-2")
    seal_events()
    killed_while_it_waits_on_a_row("inv-2", RUN_THE_WATCH)
    assert ReferenceWatch.objects.get().through_sequence == 0
    assert flagged() == ["inv-3", "inv-4"]
    assert watch_shared_references().flagged == ["inv-1", "inv-2"]
    assert Event.objects.filter(kind=FLAG).count() == 2


@pytest.mark.django_db(transaction=True)
def test_two_runs_at_once_flag_each_invocation_once(api: Api, refund: Capability) -> None:
    """Two watches in their own processes: the second waits for the first (an advisory
    lock) while the first waits on a row, then reads from where the first left off."""
    settle_all(api, "RF-1", "RF-2", "RF-1", "RF-2")
    seal_events()
    run = [sys.executable, "-c", RUN_AND_SAY]
    with (
        psycopg.connect(admin_conninfo()) as holder,
        psycopg.connect(admin_conninfo(), autocommit=True) as onlooker,
    ):
        holder.execute("SELECT 1 FROM ledger_invocation WHERE invocation_id = 'inv-2' FOR UPDATE")
        first = subprocess.Popen(run, cwd=ROOT, env=process_env(), stdout=subprocess.PIPE)

        def waiting_on(event: str, query: str) -> bool:
            found = onlooker.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND wait_event = %s AND query LIKE %s",
                [event, query],
            ).fetchone()
            return found == (1,)

        # The first waits on inv-2's row, holding the watch's lock; the second, on that.
        wait_for(lambda: waiting_on("transactionid", "%ledger_invocation%"))
        second = subprocess.Popen(run, cwd=ROOT, env=process_env(), stdout=subprocess.PIPE)
        wait_for(lambda: waiting_on("advisory", "%pg_advisory_xact_lock%"))
        holder.rollback()
        said = [process.communicate(timeout=60)[0].decode().strip() for process in (first, second)]

    assert said == ["['inv-1', 'inv-2']", "[]"]
    assert flagged() == ["inv-1", "inv-2", "inv-3", "inv-4"]
    assert Event.objects.filter(kind=FLAG).count() == 2


RUN_AND_SAY = (
    "import django; django.setup(); "
    "from ledger import shared_references; "
    "print(shared_references.watch_shared_references().flagged)"
)
RUN_THE_WATCH = (
    "import django; django.setup(); "
    "from ledger import shared_references, watches; watches.FLAGS_PER_WRITE = 1; "
    "shared_references.watch_shared_references()"
)


def test_the_watch_reads_the_events_naming_shared_references_through_their_indexes(
    api: Api, refund: Capability
) -> None:
    """Even where a sequential scan is cheap: the watch's two reads carry their partial
    indexes' conditions."""
    for n in range(12):
        settle(api, f"inv-{n}", f"RF-{n % 4}")
    seal_events()

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        sharing = sealed_sharing(0, 10_000).explain()
        namers = unflagged_namers(["RF-1", "RF-2"]).explain()

    assert any(copy in sharing for copy in copies_of_index("event_shared_reference_time")), sharing
    assert any(copy in namers for copy in copies_of_index("event_business_reference")), namers
    assert len(sealed_sharing(0, 10_000)) == 8
    assert sorted(unflagged_namers(["RF-1", "RF-2"])) == [("RF-1", "inv-1"), ("RF-2", "inv-2")]
