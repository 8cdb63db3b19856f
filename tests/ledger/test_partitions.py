"""The event table is partitioned by the month each invocation was recorded in
(migration 0033, ledger/partitions.py)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import DataError, OperationalError, ProgrammingError, connection, transaction
from django.utils import timezone

from ledger import tasks
from ledger.audit import export_rows, page_cursor, parse_cursor, search
from ledger.bundles import export_bundle
from ledger.integrity import (
    restore_projection,
    seal_events,
    verify,
    verify_next_slice,
)
from ledger.metrics import background_work, exposition
from ledger.models import Capability, Event, Invocation, SealedEvent
from ledger.partitions import create_event_partitions, month_partition, partition_state
from reconciliation.services import invocation_assign
from reconciliation.sweeper import sweep
from tests.conftest import Api, person, table_counts
from tests.ledger.conftest import at_migration, ledger_clock_at, superuser_sql
from tests.ledger.test_audit import search_ids
from tests.ledger.test_metrics import samples

pytestmark = pytest.mark.django_db


def partitions_holding(invocation_id: str) -> set[str]:
    """The tables the invocation's events are stored in."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT e.tableoid::regclass::text FROM ledger_event e "
            "JOIN ledger_invocation i ON i.id = e.invocation_id WHERE i.invocation_id = %s",
            [invocation_id],
        )
        return {name for (name,) in cursor.fetchall()}


def test_an_invocations_events_stay_in_the_month_it_was_recorded_in(
    api: Api, refund: Capability
) -> None:
    """The outcome comes a second into the next month, and joins its intent."""
    recorded = dt.datetime(2025, 10, 31, 23, 59, 59, 500000, tzinfo=dt.UTC)
    assert create_event_partitions(since=dt.datetime(2025, 10, 1, tzinfo=dt.UTC))[:2] == [
        "ledger_event_2025_10",
        "ledger_event_2025_11",
    ]
    with ledger_clock_at(recorded):
        assert api.intent(invocation_id="inv-1", attempt_id="a1")[0] == 201
    with ledger_clock_at(recorded + dt.timedelta(seconds=1)):
        assert api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")[0] == 201

    events = list(Event.objects.filter(invocation__invocation_id="inv-1").order_by("seq"))
    assert [e.created_at.month for e in events] == [10] * (len(events) - 1) + [11]
    assert {e.invocation_created_at for e in events} == {recorded}
    assert partitions_holding("inv-1") == {"ledger_event_2025_10"}
    status, body = api.get("/api/v1/invocations/inv-1")
    assert status == 200 and body["status"] == "succeeded"
    assert seal_events() is not None
    assert verify().ok


def test_partitions_are_made_months_ahead_once_each(db: None) -> None:
    now = timezone.now()
    first = month_partition(now, months_later=4)
    second = month_partition(now, months_later=5)

    assert partition_state(now).months_ahead == 3  # made by the migration
    assert tasks.create_event_partitions() == []
    assert create_event_partitions(months_ahead=5) == [first, second]
    assert create_event_partitions(months_ahead=5) == []
    assert partition_state(now).months_ahead == 5


def test_more_than_two_years_ahead_is_refused_and_nothing_made(db: None) -> None:
    """The function runs with its owner's rights and anyone may call it: it cannot be
    made to fill the catalog."""
    with pytest.raises(DataError, match="at most two years ahead"), transaction.atomic():
        create_event_partitions(months_ahead=25)
    assert partition_state().months_ahead == 3


def test_events_with_no_month_partition_go_to_the_default_one_and_read_as_any(
    api: Api, refund: Capability
) -> None:
    """Beat made no partition for March 2024 (it never makes past months): nothing is
    refused; /metrics counts them; that month gets no partition later, the others do."""
    with ledger_clock_at(dt.datetime(2024, 3, 15, 12, tzinfo=dt.UTC)):
        assert api.intent(invocation_id="inv-1", attempt_id="a1")[0] == 201
        assert api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")[0] == 201
    stored = Event.objects.filter(invocation__invocation_id="inv-1").count()

    assert partitions_holding("inv-1") == {"ledger_event_default"}
    assert partition_state().unpartitioned == stored
    figures = samples(exposition())
    assert figures[("ledger_events_unpartitioned", ())] == stored
    assert figures[("ledger_event_partitions_ahead", ())] == 3
    assert api.get("/api/v1/invocations/inv-1")[1]["status"] == "succeeded"

    warnings: list[str] = []
    raw = connection.connection
    assert isinstance(raw, psycopg.Connection)

    def heard(notice: psycopg.errors.Diagnostic) -> None:
        warnings.append(notice.message_primary or "")

    raw.add_notice_handler(heard)
    try:
        made = create_event_partitions(since=dt.datetime(2024, 2, 1, tzinfo=dt.UTC))
    finally:
        raw.remove_notice_handler(heard)
    assert made[:2] == ["ledger_event_2024_02", "ledger_event_2024_04"]
    assert warnings == [
        "events of 2024-03 are in ledger_event_default: no partition made for that month"
    ]
    assert partitions_holding("inv-1") == {"ledger_event_default"}
    assert verify().ok


def test_an_invocations_recorded_time_cannot_be_changed(api: Api, refund: Capability) -> None:
    """Its events' partition key: changing it would part an invocation's events."""
    api.intent(invocation_id="inv-1", attempt_id="a1")
    rows = Invocation.objects.filter(invocation_id="inv-1")

    with pytest.raises(ProgrammingError, match="append-only"), transaction.atomic():
        rows.update(created_at=timezone.now() - dt.timedelta(days=40))
    rows.update(assignee="olga")  # the rest of the row is the projection's to change
    row = rows.get()
    row.assignee = "petra"
    row.save()  # saving every column, created_at unchanged among them
    assert rows.get().assignee == "petra"


@pytest.mark.django_db(transaction=True)
def test_the_migration_moves_every_event_into_its_months_partition_and_back(
    api: Api, refund: Capability
) -> None:
    """Both ways, with a sealed ledger: ids, hashes and seals unchanged, and the events'
    ids go on from where they were."""
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        api.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference=f"RF-{n}")
    assert seal_events() is not None
    before = list(Event.objects.order_by("id").values_list("id", "invocation_id", "seq", "hash"))

    def kind_of_table() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT relkind FROM pg_class WHERE relname = 'ledger_event'")
            return str(cursor.fetchone()[0])

    with at_migration("0032_rate_watch"), connection.cursor() as cursor:
        assert kind_of_table() == "r"  # a plain table again
        cursor.execute("SELECT id, invocation_id, seq, hash FROM ledger_event ORDER BY id")
        assert cursor.fetchall() == before
    assert kind_of_table() == "p"
    assert list(Event.objects.order_by("id").values_list("id", "invocation_id", "seq", "hash")) == (
        before
    )
    assert partitions_holding("inv-1") == {month_partition(timezone.now())}
    assert verify().ok
    api.intent(invocation_id="inv-3", idempotency_key="k-3")
    assert Event.objects.filter(invocation__invocation_id="inv-3").get().id > before[-1][0]


def test_the_dashboard_and_metrics_say_when_partitions_fall_behind(
    api: Api, refund: Capability
) -> None:
    operator = person("olga", "operator")

    def card() -> str:
        page = operator.get("/dashboard/").content.decode()
        return page.split('id="background-work"')[1].split("</section>")[0]

    assert 'class="keeping-up">Event partitions:\n      made 3 months ahead.' in card()
    in_five_months = timezone.now() + dt.timedelta(days=5 * 31)
    assert background_work(now=in_five_months).partitions_behind
    later = samples(exposition(now=in_five_months))
    assert later[("ledger_background_behind", (("work", "partitions"),))] == 1
    assert later[("ledger_event_partitions_ahead", ())] == 0

    with ledger_clock_at(dt.datetime(2024, 3, 15, 12, tzinfo=dt.UTC)):
        api.intent(invocation_id="inv-1", attempt_id="a1")
    stored = Event.objects.filter(invocation__invocation_id="inv-1").count()
    assert f'class="behind">Event partitions:\n      {stored} events in the default partition' in (
        card()
    )
    assert samples(exposition())[("ledger_background_behind", (("work", "partitions"),))] == 1


def test_a_partition_that_would_wait_on_the_ledgers_writes_gives_up(db: None) -> None:
    """Attaching a month copies the events' foreign key, which locks the invocations
    against writes: behind that wait every write of the ledger would queue. So it
    waits at most lock_timeout (5 s), makes nothing, and the next run tries again."""
    holder = psycopg.connect(**connection.get_connection_params())
    try:
        holder.execute("UPDATE ledger_invocation SET assignee = assignee WHERE false")
        with pytest.raises(OperationalError, match="lock timeout"), transaction.atomic():
            create_event_partitions(months_ahead=4)
    finally:
        holder.rollback()
        holder.close()
    assert partition_state().months_ahead == 3
    assert len(create_event_partitions(months_ahead=4)) == 1


def test_a_sealed_events_event_is_read_in_its_own_partition_only(
    api: Api, refund: Capability
) -> None:
    """Joined by id alone, a nested loop from the sealed events would look in every
    month partition for each (0.64 to 0.72 s for a 50,000-event seal with 35 months,
    against 0.19 to 0.20 s with the partition key, in one ledger)."""
    create_event_partitions(since=dt.datetime(2025, 10, 1, tzinfo=dt.UTC))
    with ledger_clock_at(dt.datetime(2025, 10, 15, tzinfo=dt.UTC)):
        api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    api.intent(invocation_id="inv-2", idempotency_key="k-2", attempt_id="a1")
    seal = seal_events()
    assert seal is not None
    assert {e.event_invocation_created_at for e in SealedEvent.objects.all()} == set(
        Invocation.objects.values_list("created_at", flat=True)
    )

    with transaction.atomic(), connection.cursor() as cursor:
        # As a seal's check reads a large seal: a nested loop from its sealed events.
        for method in ("mergejoin", "hashjoin", "seqscan"):
            cursor.execute(f"SET LOCAL enable_{method} = off")
        sealed = SealedEvent.objects.filter(seal=seal).with_events()
        events = sealed.values_list("partitioned_event__hash")  # type: ignore[misc]
        plan = events.explain(analyze=True)

    # Each month's index is read only for the sealed events in that month.
    assert len(re.findall(r"Index Scan .* on ledger_event_", plan)) > 10, plan  # every month
    loops = re.findall(r"on ledger_event_\w+ .*\(actual .* loops=(\d+)\)", plan)
    assert sum(int(n) for n in loops) == seal.event_count, plan  # the rest never executed


def partition_counts(counter: str) -> dict[str, int]:
    """`counter` for each of the event table's partitions."""
    return table_counts(counter, "ledger\\_event\\_%")


def partitions_read(action: Callable[[], object]) -> set[str]:
    """The event table's partitions that `action` scans: those PostgreSQL pruned are
    not scanned."""
    scans = "seq_scan + coalesce(idx_scan, 0)"
    before = partition_counts(scans)
    action()
    return {name for name, count in partition_counts(scans).items() if count > before.get(name, 0)}


def events_fetched(table: str, action: Callable[[], object]) -> int:
    """The rows of the partition `table` that `action` read."""
    rows = "coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)"
    before = partition_counts(rows).get(table, 0)
    action()
    return partition_counts(rows).get(table, 0) - before


def test_the_action_log_reads_no_event_of_a_month_in_which_nobody_acted(
    api: Api, refund: Capability
) -> None:
    """It reads people's actions newest first from their own index: a month of runtime
    events alone is not walked through for them. (The tables are small here, so
    PostgreSQL is told not to read them whole.)"""
    create_event_partitions(since=dt.datetime(2025, 10, 1, tzinfo=dt.UTC))
    with ledger_clock_at(dt.datetime(2025, 10, 15, tzinfo=dt.UTC)):
        for n in range(10):
            api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    api.intent(invocation_id="inv-now", idempotency_key="k-now", attempt_id="a1")
    invocation_assign(invocation_id="inv-now", actor="user:olga", take=True)
    reviewer = person("cora", "compliance")
    page = ""

    def read_the_log() -> None:
        nonlocal page
        page = reviewer.get("/audit/actions/").content.decode()

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        assert events_fetched("ledger_event_2025_10", read_the_log) == 0
    assert "user:olga" in page and "inv-now" in page


def test_reads_that_know_an_invocations_month_read_no_other(
    api: Api, refund: Capability, tmp_path: Path
) -> None:
    create_event_partitions(since=dt.datetime(2025, 10, 1, tzinfo=dt.UTC))
    with ledger_clock_at(dt.datetime(2025, 10, 15, tzinfo=dt.UTC)):
        api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    api.intent(invocation_id="inv-2", idempotency_key="k-2", attempt_id="a1")
    october = {"ledger_event_2025_10"}
    operator = person("olga", "operator")

    assert partitions_read(lambda: api.get("/api/v1/invocations/inv-1")) == october
    both = october | {month_partition(timezone.now())}
    assert partitions_read(lambda: api.get("/api/v1/invocations")) == both
    assert partitions_read(sweep) == october  # inv-1's attempt is long overdue
    assert partitions_read(lambda: operator.get("/")) == october  # the queue
    assert partitions_read(lambda: operator.get("/invocations/inv-1/")) == october
    assert partitions_read(lambda: verify_next_slice(invocations=1)) == october
    bundled = partitions_read(lambda: export_bundle(tmp_path / "bundle", invocation_id="inv-1"))
    assert bundled == october
    # Its intent, its attempt and the sweep's flag: the whole chain, from October.
    assert len((tmp_path / "bundle" / "events.jsonl").read_text().splitlines()) == 3
    superuser_sql("UPDATE ledger_invocation SET subject = 'x' WHERE invocation_id = 'inv-1'")
    assert (
        partitions_read(
            lambda: restore_projection(invocation_id="inv-1", actor="user:ada", reason="test")
        )
        == october
    )
    assert Invocation.objects.get(invocation_id="inv-1").subject != "x"


def test_verifying_a_range_reads_the_months_of_the_invocations_it_touches(
    api: Api, refund: Capability
) -> None:
    """The events recorded in a range are of invocations of its months, or of earlier
    ones (late evidence): their chains are read whole, from those months alone."""
    create_event_partitions(since=dt.datetime(2025, 10, 1, tzinfo=dt.UTC))
    with ledger_clock_at(dt.datetime(2025, 10, 15, tzinfo=dt.UTC)):
        api.intent(invocation_id="inv-oct", idempotency_key="k-oct", attempt_id="a1")
    with ledger_clock_at(dt.datetime(2025, 11, 15, tzinfo=dt.UTC)):
        api.outcome("inv-oct", "a1", kind="succeeded")
        api.intent(invocation_id="inv-nov", idempotency_key="k-nov", attempt_id="a1")
    api.intent(invocation_id="inv-now", idempotency_key="k-now", attempt_id="a1")
    api.outcome("inv-now", "a1", kind="succeeded")
    report = None

    def verify_november() -> None:
        nonlocal report
        report = verify(
            since=dt.datetime(2025, 11, 1, tzinfo=dt.UTC),
            until=dt.datetime(2025, 12, 1, tzinfo=dt.UTC),
        )

    assert events_fetched(month_partition(timezone.now()), verify_november) == 0
    assert report is not None and report.ok, report
    touched = Event.objects.filter(invocation__invocation_id__in=["inv-oct", "inv-nov"])
    assert (report.invocations, report.events) == (2, touched.count())


def test_an_audit_search_through_events_reads_only_the_months_of_its_time_range(
    api: Api, refund: Capability
) -> None:
    """By operator or business reference, and the export: their events are in the
    months of the invocations the range lets through, and the next page's cursor
    bounds them too."""
    create_event_partitions(since=dt.datetime(2025, 10, 1, tzinfo=dt.UTC))
    for name, month in (("inv-1", 10), ("inv-2", 11)):
        with ledger_clock_at(dt.datetime(2025, month, 15, tzinfo=dt.UTC)):
            api.intent(invocation_id=name, idempotency_key=name, attempt_id="a1")
            api.outcome(name, "a1", kind="succeeded", business_reference="RF-1")
    reviewer = person("cora", "compliance")
    november = month_partition(dt.datetime(2025, 11, 1, tzinfo=dt.UTC))
    this_month = month_partition(timezone.now())

    def found(**filters: str) -> tuple[set[str], set[str]]:
        shown: set[str] = set()
        read = partitions_read(lambda: shown.update(search_ids(reviewer, **filters)))
        return shown, read

    in_november = {"since": "2025-11-01 00:00", "until": "2025-12-01 00:00"}
    assert found(business_reference="RF-1", **in_november) == ({"inv-2"}, {november})
    exported: list[dict[str, Any]] = []
    november_range = {
        "since": dt.datetime(2025, 11, 1, tzinfo=dt.UTC),
        "until": dt.datetime(2025, 12, 1, tzinfo=dt.UTC),
    }
    assert partitions_read(lambda: exported.extend(export_rows(november_range))) == {november}
    assert {row["invocation_id"] for row in exported} == {"inv-2"} and len(exported) == 3
    shown, read = found(business_reference="RF-1")
    assert shown == {"inv-1", "inv-2"} and "ledger_event_2025_10" in read and this_month in read
    after_inv_2 = parse_cursor(page_cursor(Invocation.objects.get(invocation_id="inv-2")))
    newest_first = search({"business_reference": "RF-1", "after": after_inv_2})
    # The months after the cursor's are left out of the plan; the default partition
    # stays, for the months before October that have none.
    planned = set(re.findall(r" on (ledger_event_\w+)", newest_first.explain()))
    assert planned == {"ledger_event_2025_10", november, "ledger_event_default"}
    assert [row.invocation_id for row in newest_first] == ["inv-1"]
