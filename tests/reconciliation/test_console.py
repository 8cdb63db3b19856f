"""The operator console: pages, fragments, permissions, actions and guard rails."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.http import QueryDict
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from ledger import audit, capabilities, metrics
from ledger.capabilities import capability_settings_change
from ledger.integrity import seal_events, verify_next_slice
from ledger.models import Capability, Event, Invocation
from ledger.rate_limits import watch_rate_limits
from ledger.services import flag_missing_evidence, flag_missing_evidence_of
from ledger.shared_references import watch_shared_references
from ledger.templatetags.console import ahead
from reconciliation import probes, services, tasks, views
from reconciliation.forms import QueueFilterForm
from reconciliation.probes import Finding, ProbeResult
from reconciliation.services import (
    expire_lease,
    invocation_assign,
    invocation_claim,
    probe_requested,
    probes_requested,
    release_lost_claim,
)
from reconciliation.standin import StandInService
from reconciliation.tasks import reconcile_invocation, request_probes
from tests.conftest import (
    Api,
    invocation_rows_read,
    person,
    process_env,
    registered,
    wait_for,
)
from tests.ledger.test_metrics import samples
from tests.reconciliation.conftest import BrokerQueue, perform_refund, reported_lost, status_of


def flag(api: Api) -> None:
    """inv-1, its attempt a1 past its deadline with no outcome: flagged by the sweep."""
    api.intent(attempt_id="a1")
    deadline = Invocation.objects.get().deadline_at
    assert deadline is not None and flag_missing_evidence(invocation_id="inv-1", now=deadline)


@pytest.fixture
def flagged(api: Api, refund: Capability) -> str:
    registered("refund.create", risk_level="medium")  # its second declaration
    flag(api)
    return "inv-1"


@pytest.fixture
def flagged_high_risk(api: Api, refund: Capability) -> str:
    """inv-1 flagged, its capability high-risk when its intent was recorded."""
    flag(api)
    return "inv-1"


@pytest.fixture
def operator(db: None) -> Client:
    return person("olga", "operator")


@pytest.fixture
def compliance(db: None) -> Client:
    return person("carl", "compliance")


PAGES = ["/", "/dashboard/", "/invocations/inv-1/", "/queue/counts"]


@pytest.mark.parametrize("path", PAGES)
def test_anonymous_people_are_sent_to_log_in(flagged: str, client: Client, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/")


@pytest.mark.parametrize("path", PAGES)
def test_people_without_a_role_are_refused(flagged: str, path: str) -> None:
    assert person("outsider").get(path).status_code == 403


@pytest.mark.parametrize("path", PAGES)
def test_every_role_can_read(flagged: str, compliance: Client, path: str) -> None:
    assert compliance.get(path).status_code == 200


def test_the_queue_lists_flagged_invocations_full_page_or_fragment(
    flagged: str, operator: Client
) -> None:
    page = operator.get("/").content.decode()
    assert "<html" in page and "inv-1" in page and "reconciliation_required" in page
    fragment = operator.get("/", {"risk": "medium"}, headers={"HX-Request": "true"})
    body = fragment.content.decode()
    assert "<html" not in body and body.lstrip().startswith('<section id="queue-rows"')
    assert "inv-1" in body
    filtered = operator.get("/", {"risk": "low"}, headers={"HX-Request": "true"}).content.decode()
    assert "inv-1" not in filtered and "Nothing needs reconciliation" in filtered


def counted(request: Callable[[], object]) -> bool:
    """Whether `request` counted the queue by status."""
    with CaptureQueriesContext(connection) as queries:
        request()
    return any("COUNT(" in query["sql"] for query in queries.captured_queries)


def test_a_runtime_that_does_not_exist_selects_nothing_in_the_queue(
    flagged: str, operator: Client
) -> None:
    """Its id is looked up first: a name that finds none must not drop the filter."""
    assert queue_page(operator, "runtime=runtime-a") == (["inv-1"], None)
    assert queue_page(operator, "runtime=no-such-runtime") == ([], None)


def test_the_rows_a_filter_swaps_in_are_read_without_the_counts(
    flagged: str, operator: Client
) -> None:
    """The counts show on the whole page and refresh on their own; the rows alone, for
    a filter or the next page, do not show them, so they are not counted for them."""
    assert counted(lambda: operator.get("/", {"risk": "medium"}))
    assert not counted(
        lambda: operator.get("/", {"risk": "medium"}, headers={"HX-Request": "true"})
    )
    assert counted(lambda: operator.get("/queue/counts"))


def test_compliance_sees_no_action_and_cannot_post(flagged: str, compliance: Client) -> None:
    page = compliance.get("/invocations/inv-1/").content.decode()
    assert "Resolve" not in page and "I'm on it" not in page
    for action in ("resolve", "claim", "release", "probe", "approve", "reject", "restore"):
        response = compliance.post(f"/invocations/inv-1/{action}", {"seen_event_count": 3})
        assert response.status_code == 403, action
    assert Invocation.objects.get().status == "reconciliation_required"


def test_an_operator_resolves_with_a_note_and_the_invocation_leaves_the_queue(
    flagged: str, operator: Client
) -> None:
    seen = Invocation.objects.get().event_count
    response = operator.post(
        "/invocations/inv-1/resolve",
        {
            "effect": "effect_absent",
            "note": "not in the payments console",
            "seen_event_count": seen,
        },
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 200
    assert '<section id="detail">' in response.content.decode()
    invocation = Invocation.objects.get()
    assert invocation.status == "retry_allowed"
    event = invocation.events.get(kind="resolution")
    assert (event.actor, event.data["note"]) == ("user:olga", "not in the payments console")
    assert "inv-1" not in operator.get("/").content.decode()


def test_a_resolution_without_note_or_reference_is_refused_in_place(
    flagged: str, operator: Client
) -> None:
    seen = Invocation.objects.get().event_count
    response = operator.post(
        "/invocations/inv-1/resolve",
        {"effect": "effect_present", "note": "", "seen_event_count": seen},
    )
    assert response.status_code == 400
    page = response.content.decode()
    assert "This field is required." in page and "Name the business reference" in page
    assert Invocation.objects.get().status == "reconciliation_required"


def test_a_stale_page_is_refused_and_nothing_is_applied(flagged: str, operator: Client) -> None:
    stale = Invocation.objects.get().event_count - 1
    response = operator.post(
        "/invocations/inv-1/resolve",
        {"effect": "effect_absent", "note": "n", "seen_event_count": stale},
    )
    assert response.status_code == 303
    assert Invocation.objects.get().status == "reconciliation_required"
    page = operator.get("/invocations/inv-1/").content.decode()
    assert page.count("changed since this page was loaded") == 1
    # In place, with htmx: the fragment says it, once.
    response = operator.post(
        "/invocations/inv-1/resolve",
        {"effect": "effect_absent", "note": "n", "seen_event_count": stale},
        headers={"HX-Request": "true"},
    )
    assert response.status_code == 409
    assert response.content.decode().count("changed since this page was loaded") == 1


def test_a_double_submit_resolves_once(flagged: str, operator: Client) -> None:
    seen = Invocation.objects.get().event_count
    form = {"effect": "effect_absent", "note": "twice", "seen_event_count": seen}
    operator.post("/invocations/inv-1/resolve", form)
    operator.post("/invocations/inv-1/resolve", form)
    assert Invocation.objects.get().events.filter(kind="resolution").count() == 1


def test_claiming_keeps_two_operators_apart(flagged: str, operator: Client) -> None:
    other = person("otto", "operator")
    seen = Invocation.objects.get().event_count
    operator.post("/invocations/inv-1/claim", {"seen_event_count": seen})
    assert Invocation.objects.get().assignee == "olga"
    other.post("/invocations/inv-1/claim", {"seen_event_count": seen + 1})
    assert Invocation.objects.get().assignee == "olga"
    mine = operator.get("/", {"mine": "mine"}).content.decode()
    assert "inv-1" in mine
    assert "inv-1" not in other.get("/", {"mine": "mine"}).content.decode()


def test_the_queue_filters_by_age_and_by_who_is_on_it(
    api: Api, flagged: str, operator: Client
) -> None:
    """inv-1 flagged now and taken by olga; inv-2 flagged two hours ago, nobody on it."""
    api.intent(invocation_id="inv-2", idempotency_key="refund-SO-2", attempt_id="a1")
    api.outcome("inv-2", "a1", kind="post_dispatch_evidence_failed")
    two_hours_ago = timezone.now() - dt.timedelta(hours=2)
    Invocation.objects.filter(invocation_id="inv-2").update(flagged_at=two_hours_ago)
    invocation_assign(invocation_id="inv-1", actor="user:olga", take=True)
    assert sorted(queue_page(operator)[0]) == ["inv-1", "inv-2"]
    assert queue_page(operator, "older_than_minutes=60") == (["inv-2"], None)
    assert queue_page(operator, "older_than_minutes=180") == ([], None)
    assert queue_page(operator, "mine=unclaimed") == (["inv-2"], None)
    assert queue_page(operator, "mine=mine") == (["inv-1"], None)
    assert queue_page(person("otto", "operator"), "mine=mine") == ([], None)


def test_high_risk_needs_a_second_different_approver(
    api: Api, flagged_high_risk: str, operator: Client
) -> None:
    seen = Invocation.objects.get().event_count
    operator.post(
        "/invocations/inv-1/resolve",
        {"effect": "effect_present", "business_reference": "RF-1", "note": "seen it",
         "seen_event_count": seen},
    )  # fmt: skip
    assert Invocation.objects.get().status == "resolution_proposed"
    seen = Invocation.objects.get().event_count
    assert (
        operator.post("/invocations/inv-1/approve", {"seen_event_count": seen}).status_code == 403
    )
    self_approver = person("ada", "operator", "approver")
    page = self_approver.get("/invocations/inv-1/").content.decode()
    assert '<label for="id_note">note (optional)</label>' in page
    assert "A person's resolution awaits a second person below." in page
    assert (
        '<p class="proposed">user:olga says <strong>the effect happened</strong>, business '
        "reference <code>RF-1</code>: “seen it”</p>"
    ) in page
    assert "Resolve it below" not in page
    assert "named by the proposed resolution" in references_section(page.encode())
    self_approver.post("/invocations/inv-1/reject", {"seen_event_count": seen, "note": "check"})
    assert Invocation.objects.get().status == "escalated"


def flag_many(api: Api, prefix: str, count: int) -> None:
    """`count` invocations of refund.create, recorded by one batch with their first
    attempts, then flagged as overdue (`prefix-0` …)."""
    ids = [f"{prefix}-{n}" for n in range(count)]
    items = [
        {"type": "intent", "invocation_id": invocation_id, "task_id": "t",
         "capability": "refund.create", "arguments": {}, "idempotency_key": invocation_id,
         "attempt_id": "a1"}
        for invocation_id in ids
    ]  # fmt: skip
    api.post("/api/v1/evidence", items)
    deadline = Invocation.objects.first().deadline_at  # type: ignore[union-attr]
    assert flag_missing_evidence_of(invocation_ids=ids, now=deadline) == ids


def test_counts_in_the_thousands_are_grouped(
    api: Api, refund: Capability, operator: Client
) -> None:
    flag_many(api, "c", 1000)

    page = operator.get("/dashboard/").content.decode()
    assert "<td>reconciliation_required</td><td>1,000</td>" in page
    assert '<span class="count reconciliation_required">reconciliation_required <strong>1,000' in (
        operator.get("/").content.decode()
    )


def test_the_queue_and_the_invocation_page_keep_their_query_counts(
    api: Api, refund: Capability, operator: Client
) -> None:
    flag_many(api, "q", 200)
    with CaptureQueriesContext(connection) as queue:
        assert operator.get("/").status_code == 200
    with CaptureQueriesContext(connection) as detail:
        assert operator.get("/invocations/q-7/").status_code == 200
    assert len(queue) <= 6, [q["sql"][:80] for q in queue]
    assert len(detail) <= 8, [q["sql"][:80] for q in detail]


def test_the_queue_marks_a_row_changed_outside_the_ledger(
    api: Api, refund: Capability, operator: Client
) -> None:
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        assert flag_missing_evidence(
            invocation_id=f"inv-{n}", now=timezone.now() + dt.timedelta(days=7)
        )
    Invocation.objects.filter(invocation_id="inv-2").update(cause="no_probe")

    rows = operator.get("/").content.decode().split('id="queue-rows"')[1].split("<tr")[2:]

    marked = {
        re.findall(r'href="/invocations/([^/]+)/"', row)[0]: "changed outside the ledger" in row
        for row in rows
    }
    assert marked == {"inv-1": False, "inv-2": True}


def queue_page(operator: Client, query: str = "", **headers: str) -> tuple[list[str], str | None]:
    """The invocation ids a queue page lists, in order, and its next page's query."""
    page = operator.get(f"/?{query}", headers=headers).content.decode()
    rows = page.split('id="queue-rows"')[1]
    listed = re.findall(r'href="/invocations/([^/]+)/"', rows)
    following = re.search(r'href="/\?([^"]*)"[^>]*>Next page<', rows)
    return listed, following and following[1].replace("&amp;", "&")


def test_the_queue_pages_riskiest_first_and_never_cuts_a_risky_one_off(
    api: Api, refund: Capability, operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(views, "QUEUE_PAGE", 3)
    Capability.objects.create(scope="note.add", risk_level="low")
    items = [
        {"type": "intent", "invocation_id": f"{scope}-{n}", "task_id": "t", "capability": scope,
         "subject": f"customer-{n}", "arguments": {}, "idempotency_key": f"k-{n}",
         "attempt_id": "a1"}
        for scope, count in (("note.add", 5), ("refund.create", 1)) for n in range(count)
    ]  # fmt: skip
    api.post("/api/v1/evidence", items)
    deadline = Invocation.objects.get(invocation_id="refund.create-0").deadline_at
    assert deadline is not None
    for n in (0, 1, 2, 3):  # the low-risk ones are flagged first, so they are the oldest
        flag_missing_evidence(invocation_id=f"note.add-{n}", now=deadline)
    flag_missing_evidence(invocation_id="refund.create-0", now=deadline + dt.timedelta(minutes=5))
    flag_missing_evidence(invocation_id="note.add-4", now=deadline + dt.timedelta(minutes=6))

    first, following = queue_page(operator)
    assert first == ["refund.create-0", "note.add-0", "note.add-1"]
    assert "<td>customer-0</td>" in operator.get("/").content.decode()
    assert following is not None and "after=" in following

    # Resolved while the first page was being read: the next page neither repeats a
    # row nor skips one, as an offset would.
    read = Invocation.objects.get(invocation_id="note.add-0")
    operator.post(
        "/invocations/note.add-0/resolve",
        {"effect": "effect_absent", "note": "no such note", "seen_event_count": read.event_count},
    )
    assert Invocation.objects.get(invocation_id="note.add-0").status == "retry_allowed"
    second, last = queue_page(operator, following)
    assert second == ["note.add-2", "note.add-3", "note.add-4"]
    assert last is None
    # The htmx link swaps in the rows alone, with a way back to the first page.
    fragment = operator.get(f"/?{following}", headers={"HX-Request": "true"}).content.decode()
    assert fragment.lstrip().startswith('<section id="queue-rows">')
    assert ">First page<" in fragment and "<h1>" not in fragment

    # A filter's pages keep the filter.
    low, low_next = queue_page(operator, "risk=low")
    assert low == ["note.add-1", "note.add-2", "note.add-3"]
    assert low_next is not None and "risk=low" in low_next
    assert queue_page(operator, low_next) == (["note.add-4"], None)
    assert queue_page(operator, "capability=refund.create") == (["refund.create-0"], None)


def test_a_queue_page_is_read_in_the_queues_order_from_its_index(
    api: Api, refund: Capability, operator: Client
) -> None:
    """No sort of every flagged invocation for a page: however long the queue grows, a
    page costs a page. (The tables are small here, so PostgreSQL is told to take any
    other way it has before reading them whole or sorting them. That the counts read
    the index alone shows at scale only, once vacuum has marked the table's pages all
    visible: `bench_audit`.)"""
    flag(api)
    with CaptureQueriesContext(connection) as queries:
        operator.get("/")
    page = next(
        query["sql"]
        for query in queries.captured_queries
        if 'FROM "ledger_invocation"' in query["sql"] and "ORDER BY" in query["sql"]
    )
    with transaction.atomic(), connection.cursor() as cursor:
        for way in ("seqscan", "bitmapscan", "sort"):
            cursor.execute(f"SET LOCAL enable_{way} = off")
        cursor.execute(f"EXPLAIN {page}")
        plan = "\n".join(line for (line,) in cursor.fetchall())
    assert "using invocation_queue_order" in plan and "Sort" not in plan, plan


def notes_in_flight(api: Api, count: int) -> None:
    """note-00, note-01, …: intents of note.add, each with its first attempt admitted."""
    api.post("/api/v1/evidence", [
        {"type": "intent", "invocation_id": f"note-{n:02}", "task_id": "t",
         "capability": "note.add", "subject": "s", "arguments": {},
         "idempotency_key": f"k-{n}", "attempt_id": "a1"}
        for n in range(count)
    ])  # fmt: skip


def test_a_deep_queue_page_reads_a_page(
    api: Api, operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next page starts where the last ended in invocation_queue_order itself, ties
    and all, so the fourth page reads the fourth page's rows, not the three before it
    again."""
    monkeypatch.setattr(views, "QUEUE_PAGE", 3)
    Capability.objects.create(scope="note.add", risk_level="low")
    notes_in_flight(api, 14)
    deadline = Invocation.objects.get(invocation_id="note-00").deadline_at
    assert deadline is not None
    for n in range(14):  # in two ties of flagged_at, the second flagged first
        flagged_at = deadline + dt.timedelta(minutes=0 if n >= 7 else 1)
        assert flag_missing_evidence(invocation_id=f"note-{n:02}", now=flagged_at)
    queue_order = [f"note-{n:02}" for n in (*range(7, 14), *range(7))]

    listed, following = queue_page(operator)
    next_queries = []
    while following is not None:
        next_queries.append(following)
        page, following = queue_page(operator, following)
        listed += page
    assert listed == queue_order

    fourth, fetched = rows_read_for(next_queries[2], "olga")
    assert fourth == queue_order[9:13]
    assert fetched == len(fourth), fetched


def rows_read_for(query: str, user: str) -> tuple[list[str], int]:
    """The invocations the queue's first page lists for `query`, and the invocation
    rows PostgreSQL read for it."""
    form, person = QueueFilterForm(QueryDict(query)), User.objects.get(username=user)
    rows, fetched = invocation_rows_read(lambda: views.queue_rows(form, person))
    return [row.invocation_id for row in rows], fetched


@pytest.mark.parametrize(
    "query",
    ["cause=evidence_reported_lost", "capability=refund.create", "runtime=runtime-b",
     "mine=mine", "risk=low"],
)  # fmt: skip
def test_a_filtered_queue_page_reads_the_rows_it_lists(
    query: str, api: Api, api_b: Api, operator: Client
) -> None:
    """Two invocations that each filter selects, queued behind twelve it does not: the
    page reads the two, not the queue up to them."""
    Capability.objects.create(scope="note.add", risk_level="high")
    registered("refund.create", risk_level="low")
    notes_in_flight(api, 12)
    for n in range(12):
        assert flag_missing_evidence(
            invocation_id=f"note-{n:02}", now=timezone.now() + dt.timedelta(days=1)
        )
    selected = ["refund-0", "refund-1"]
    for invocation_id in selected:
        api_b.intent(invocation_id=invocation_id, idempotency_key=invocation_id, attempt_id="a1")
        api_b.outcome(invocation_id, "a1", kind="post_dispatch_evidence_failed")
        invocation_assign(invocation_id=invocation_id, actor="user:olga", take=True)

    listed, fetched = rows_read_for(query, "olga")
    assert listed == selected
    assert fetched == len(selected), fetched


@pytest.mark.parametrize(
    "after", ["yesterday", "0-1", "3-0-1", "0-99999999999999999999999-1", f"0-0-{2**63}", "0-0-"]
)
def test_a_page_cursor_not_from_the_queue_is_refused_by_name(
    flagged: str, operator: Client, after: str
) -> None:
    response = operator.get("/", {"after": after})
    page = response.content.decode()
    assert response.status_code == 200
    assert "not a page cursor from this queue" in page
    assert "/invocations/inv-1/" not in page


def test_login_attempts_are_throttled(db: None, client: Client) -> None:
    User.objects.create_user("eve", password="right")
    for _ in range(5):
        client.post("/accounts/login/", {"username": "eve", "password": "wrong"})
    response = client.post("/accounts/login/", {"username": "eve", "password": "right"})
    assert response.status_code == 429
    assert "Too many failed attempts" in response.content.decode()


def test_an_invocation_recorded_with_a_slash_in_its_id_stays_reachable(
    flagged: str, operator: Client
) -> None:
    # Ids with "/" were accepted before the API refused them; one in the queue made
    # every operator's queue a 500 (no URL could be reversed for it).
    Invocation.objects.filter(invocation_id=flagged).update(invocation_id="tenant/42")
    queue = operator.get("/")
    assert queue.status_code == 200
    assert 'href="/invocations/tenant/42/"' in queue.content.decode()
    page = operator.get("/invocations/tenant/42/")
    assert page.status_code == 200
    assert "tenant/42" in page.content.decode()
    claimed = operator.post("/invocations/tenant/42/claim")
    assert claimed.status_code == 303
    assert Invocation.objects.get().assignee == "olga"


@pytest.mark.parametrize("path", ["/invocations/%00/", "/invocations/a%00b/claim"])
def test_a_path_postgresql_cannot_compare_is_not_found(operator: Client, path: str) -> None:
    assert operator.get(path).status_code == 404


def test_a_login_lockout_holds_across_web_processes(web_processes: list[str]) -> None:
    """Failures counted by one process refuse the next attempt at another."""
    User.objects.create_user("eve", password="right")

    def log_in(url: str, password: str) -> httpx.Response:
        with httpx.Client(base_url=url) as browser:
            page = browser.get("/accounts/login/").text
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
            assert token is not None
            return browser.post(
                "/accounts/login/",
                data={"username": "eve", "password": password, "csrfmiddlewaretoken": token[1]},
            )

    first, second = web_processes
    for url in (first, second, first, second, first):
        assert log_in(url, "wrong").status_code == 200  # the form again, with its error
    refused = log_in(second, "right")
    assert refused.status_code == 429
    assert "Too many failed attempts" in refused.text


def test_pages_carry_a_csp_with_a_nonce_and_no_cdn(flagged: str, operator: Client) -> None:
    response = operator.get("/")
    policy = response["Content-Security-Policy"]
    assert "script-src 'self' 'nonce-" in policy
    page = response.content.decode()
    assert '/static/vendor/htmx-2.min.js" nonce="' in page
    assert "https://" not in page


def test_resolving_a_settled_invocation_is_refused_with_a_message(
    flagged: str, operator: Client
) -> None:
    seen = Invocation.objects.get().event_count
    form = {"effect": "effect_absent", "note": "first", "seen_event_count": seen}
    operator.post("/invocations/inv-1/resolve", form)
    settled = Invocation.objects.get()
    form = {"effect": "effect_absent", "note": "again", "seen_event_count": settled.event_count}
    response = operator.post("/invocations/inv-1/resolve", form, follow=True)
    assert "nothing to resolve" in response.content.decode()
    assert Invocation.objects.get().event_count == settled.event_count


def test_an_invocation_awaiting_its_outcome_says_when_it_will_be_flagged(
    api: Api, refund: Capability, operator: Client
) -> None:
    """An operator asked about an in-flight call sees by when the runtime must report
    before the ledger flags it (its timeout and grace after admission), and that the
    sweep will once that is past."""
    api.intent(attempt_id="a1")
    deadline = Invocation.objects.get().deadline_at
    assert deadline is not None
    when = timezone.localtime(deadline).strftime("%Y-%m-%d %H:%M:%S")
    page = operator.get("/invocations/inv-1/").content.decode()
    assert "flagged unless its outcome comes by</dt><dd><time datetime=" in page
    assert f"{when} UTC</time> (in {ahead(deadline)})" in page
    Invocation.objects.update(deadline_at=deadline - dt.timedelta(minutes=5))
    page = operator.get("/invocations/inv-1/").content.decode()
    assert "(past: the sweep flags it at its next run)" in page
    assert flag_missing_evidence(invocation_id="inv-1", now=deadline)
    assert "flagged unless" not in operator.get("/invocations/inv-1/").content.decode()


def test_a_web_process_sends_the_consoles_probe_job_where_the_workers_read(
    broker_queue: BrokerQueue,
) -> None:
    # A new process, as gunicorn's workers are: this one already made the project's
    # Celery app for its own workers, and would hide one that never does.
    sent = subprocess.run(
        [sys.executable, "-c", "import ledger.wsgi\n"
         "from reconciliation.tasks import reconcile_invocation\n"
         "reconcile_invocation.delay('inv-1', force=True)"],
        env=process_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert broker_queue.jobs() == 1


def test_rerunning_the_probe_is_recorded_as_the_operators_action(
    api: Api, refunds: Capability, operator: Client
) -> None:
    flag(api)
    assert "Re-run probe now" in operator.get("/invocations/inv-1/").content.decode()
    operator.post("/invocations/inv-1/probe")
    event = Invocation.objects.get().events.get(kind="probe_requested")
    assert (event.actor, event.data["queued"]) == ("user:olga", True)


@pytest.fixture
def broker_down() -> Iterator[None]:
    """The console's Celery app publishes to a port where nothing listens."""
    from ledger.celery import app

    def publish_to(url: str | None) -> None:
        # The app keeps a connection pool and a producer pool for the URL it started on.
        app.conf.broker_write_url = url
        app._pool = None
        app.amqp._producer_pool = None

    publish_to("redis://127.0.0.1:9/0")
    try:
        yield
    finally:
        publish_to(None)


def test_a_probe_the_broker_cannot_take_is_reported_not_a_500(
    api: Api, refunds: Capability, operator: Client, broker_down: None
) -> None:
    flag(api)
    response = operator.post("/invocations/inv-1/probe", follow=True)
    assert response.status_code == 200
    page = response.content.decode()
    assert "the task broker is unreachable" in page
    assert "Probe queued" not in page
    # The operator's request is evidence of what they did, queued or not.
    requested = Invocation.objects.get().events.get(kind="probe_requested")
    assert requested.data["queued"] is False


def test_without_a_probe_none_is_offered_or_run(flagged: str, operator: Client) -> None:
    page = operator.get(f"/invocations/{flagged}/").content.decode()
    assert "Re-run probe now" not in page
    assert "Its capability has no probe" in page
    seen = Invocation.objects.get().event_count

    answer = operator.post(f"/invocations/{flagged}/probe", follow=True).content.decode()

    assert "Its capability has no probe; resolve it below." in answer
    assert Invocation.objects.get().event_count == seen


ACTIONS = ["resolve", "claim", "release", "probe", "approve", "reject"]


@pytest.mark.parametrize("action", ACTIONS)
def test_anonymous_and_outsider_posts_change_nothing(
    flagged: str, client: Client, action: str
) -> None:
    before = Invocation.objects.get().event_count
    anonymous = client.post(f"/invocations/inv-1/{action}", {"seen_event_count": before})
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous["Location"]
    outsider = person(f"x-{action}").post(
        f"/invocations/inv-1/{action}", {"seen_event_count": before}
    )
    assert outsider.status_code == 403
    assert Invocation.objects.get().event_count == before


def test_the_invocation_page_shows_arguments_as_json_and_the_outcomes_error(
    api: Api, refund: Capability, operator: Client
) -> None:
    api.intent(arguments={"order": "SO-1", "amount": "12.50", "api_key": "k-123"}, attempt_id="a1")
    api.outcome(
        "inv-1",
        "a1",
        kind="post_dispatch_evidence_failed",
        error={"code": "recorder_timeout", "message": "the gateway lost the answer"},
    )

    page = operator.get("/invocations/inv-1/").content.decode()

    shown = re.search(r'<pre class="json">(.*?)</pre>', page, re.DOTALL)
    assert shown is not None
    # HTML-escaped JSON with sorted keys; the secret-looking key masked as stored.
    assert shown.group(1) == (
        "{\n  &quot;amount&quot;: &quot;12.50&quot;,\n  &quot;api_key&quot;: "
        "&quot;[redacted]&quot;,\n  &quot;order&quot;: &quot;SO-1&quot;\n}"
    )
    assert "<code>recorder_timeout</code> the gateway lost the answer" in page


def probe_rows(page: bytes) -> str:
    found = re.search(r'<table class="probes">.*?<tbody>(.*?)</tbody>', page.decode(), re.DOTALL)
    assert found is not None
    return found.group(1)


def test_the_probe_runs_table_shows_what_was_asked_and_answered(
    api: Api, refunds: Capability, standin: StandInService, operator: Client
) -> None:
    flag(api)
    refund = perform_refund(standin, "refund-SO-1").json()
    reconcile_invocation.run("inv-1")

    row = probe_rows(operator.get("/invocations/inv-1/").content)

    assert "<td>effect_present</td>" in row
    assert f"<td>{refund['id']}</td>" in row
    assert "idempotency_key=refund-SO-1</code>" in row
    assert "<td>200 — present rule: status = &quot;succeeded&quot;</td>" in row
    assert re.search(r"<td>\d+ ms</td>", row)


@override_settings(LEDGER_PROBE_BACKOFF_SECONDS=5)
def test_the_probe_runs_table_says_why_an_answer_decided_nothing(
    api: Api, refunds: Capability, standin: StandInService, operator: Client
) -> None:
    flag(api)
    standin.refunds.set_mode("429")
    reconcile_invocation.run("inv-1")

    row = probe_rows(operator.get("/invocations/inv-1/").content)

    assert "<td>inconclusive</td>" in row
    assert "<td>429 — no rule matched status 429 (asked to wait 30 s)</td>" in row


def test_an_invocation_escalated_for_want_of_a_probe_shows_its_page(
    flagged: str, operator: Client
) -> None:
    """The probe run of a capability without a probe records no finding and no detail:
    the page once answered 500 for exactly the invocations handed to people."""
    reconcile_invocation.run(flagged)
    assert Invocation.objects.get().cause == "no_probe"

    response = operator.get(f"/invocations/{flagged}/")

    assert response.status_code == 200
    assert "<td>no probe: handed to a person</td>" in probe_rows(response.content)


def dashboard_card(client: Client, name: str = "background-work") -> str:
    """One card of the dashboard, as the client sees it."""
    page = client.get("/dashboard/").content.decode()
    return page.split(f'id="{name}"')[1].split("</section>")[0]


def test_the_dashboard_and_metrics_count_probe_findings_per_capability_no_probe_apart(
    api: Api, refunds: Capability, standin: StandInService, operator: Client
) -> None:
    """An invocation handed to a person for want of a probe is not a probe that found
    nothing: the card once counted it as inconclusive. /metrics counts the runs that
    found no probe together, whatever scopes the runtimes named."""
    reported_lost(api, "inv-found")
    perform_refund(standin, "k-inv-found")
    reconcile_invocation.run("inv-found")
    reported_lost(api, "inv-unreachable")
    standin.stop()  # the probe cannot reach the business system: inconclusive
    reconcile_invocation.run("inv-unreachable")
    reported_lost(api, "inv-undeclared", capability="payroll.update")
    reconcile_invocation.run("inv-undeclared")

    flagged = dashboard_card(operator, "flagged")
    assert '<a href="/?capability=payroll.update">payroll.update</a>' in flagged
    card = dashboard_card(operator, "probes")
    rows = [
        re.sub(r"<[^>]+>", " ", row).split()
        for row in re.findall(r"<tr><td>(.*?)</tr>", card, re.DOTALL)
    ]

    assert rows == [
        ["refund.create", "2", "1", "(50%)", "0"],
        ["payroll.update", "0", "-", "1"],
    ]
    assert 'href="/audit/?capability=payroll.update"' in card
    assert "probes-concluding-nothing" not in card  # refund.create's rules name its answers
    runs = {
        dict(labels)["capability"] + " " + dict(labels)["finding"]: value
        for (name, labels), value in samples(metrics.exposition()).items()
        if name == "ledger_probe_runs_last_hour"
    }
    assert runs == {"refund.create effect_present": 1, "refund.create inconclusive": 1, " none": 1}


def test_the_dashboard_counts_the_probes_sent_again_after_their_worker_was_lost_or_hung(
    api: Api, refunds: Capability, operator: Client
) -> None:
    assert "0 whose worker was lost" in dashboard_card(operator, "probes")
    now = timezone.now()
    for invocation_id in ("inv-killed-1", "inv-killed-2", "inv-hung"):
        reported_lost(api, invocation_id)
        assert invocation_claim(invocation_id=invocation_id, worker="w1", now=now)
    # No session holds their probe locks: their worker is gone.
    assert release_lost_claim(invocation_id="inv-killed-1", now=now)
    assert release_lost_claim(invocation_id="inv-killed-2", now=now)
    assert expire_lease(invocation_id="inv-hung", now=now + dt.timedelta(seconds=61))

    card = dashboard_card(operator, "probes")
    reopened = re.sub(r"<[^>]+>", "", card.split('id="reopened-claims">')[1].split("</p>")[0])
    assert reopened == (
        "probes sent again: 2 whose worker was lost (killed while probing), "
        "1 whose worker held its lease past its end (hung)"
    )


def test_the_dashboard_says_when_beats_work_falls_behind(
    api: Api, refund: Capability, operator: Client
) -> None:
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")

    assert "Sweeper:\n      keeping up." in dashboard_card(operator)
    assert "Sealer:\n      no seal yet." in dashboard_card(operator)
    # Two minutes past its deadline and still in flight: no sweep has run since.
    Invocation.objects.update(deadline_at=timezone.now() - dt.timedelta(minutes=2))
    stalled = dashboard_card(operator)
    assert 'class="behind">Sweeper' in stalled
    assert "1 attempt past the deadline, the oldest for 2" in stalled
    assert 'class="keeping-up">Sealer' in stalled  # its first event is seconds old


def test_the_dashboard_shows_the_rate_watch_once_a_limit_is_declared(
    api: Api, operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "Rate watch" not in dashboard_card(operator)
    registered("refund.create", rate_limit={"count": 1, "window": "1h"})
    watch_rate_limits()
    assert "Rate watch:\n      keeping up." in dashboard_card(operator)
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    seal_events()
    monkeypatch.setattr(metrics, "MISSED_RATE_WATCHES", 0)  # behind at once, not in 10 min
    assert (
        'class="behind">Rate watch:\n      behind, a seal unread for ten intervals'
        in dashboard_card(operator)
    )
    Invocation.objects.filter(invocation_id="inv-2").update(head_hash="0" * 64)
    watch_rate_limits()
    caught_up = dashboard_card(operator)
    assert "Rate watch:\n      keeping up." in caught_up
    assert (
        "1 attempt admitted beyond a declared rate limit waits to be flagged: their "
        "invocations' rows were changed outside the ledger."
    ) in caught_up


def test_the_dashboard_shows_each_enforced_rate_limits_window_and_when_it_is_full(
    api: Api, operator: Client
) -> None:
    registered("refund.create", rate_limit={"count": 2, "window": "1h"})
    assert 'id="rate-limits"' not in operator.get("/dashboard/").content.decode()
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="payments' limit", rate_limit_enforced=True
    )
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    assert "1 of 2 in the last 1h</td>" in dashboard_card(operator, "rate-limits")
    api.intent(invocation_id="inv-2", idempotency_key="k-2", attempt_id="a1")
    full = dashboard_card(operator, "rate-limits")
    assert '<tr class="behind">' in full
    assert "2 of 2 in the last 1h: full, admissions refused</td>" in full


def test_the_dashboard_shows_the_reference_watch_and_the_flags_waiting_for_an_admin(
    api: Api, refund: Capability, operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "Reference watch:\n      no sealed event read yet." in dashboard_card(operator)
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        api.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference="RF-1")
    seal_events()
    monkeypatch.setattr(metrics, "MISSED_REFERENCE_WATCHES", 0)  # behind at once
    assert 'class="behind">Reference watch:\n      behind, a seal unread for ten' in dashboard_card(
        operator
    )
    Invocation.objects.filter(invocation_id="inv-1").update(head_hash="0" * 64)
    watch_shared_references()
    caught_up = dashboard_card(operator)
    assert "Reference watch:\n      keeping up." in caught_up
    assert (
        "1 invocation naming a business reference that a later invocation named too waits "
        "to be flagged: their rows were changed outside the ledger."
    ) in caught_up


def test_the_dashboard_names_overdue_rows_the_sweep_refuses_and_is_not_alarmed(
    api: Api, refund: Capability, operator: Client
) -> None:
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    # Long overdue, and changed outside the ledger: every sweep refuses it.
    Invocation.objects.update(
        deadline_at=timezone.now() - dt.timedelta(minutes=2), head_hash="0" * 64
    )

    card = dashboard_card(operator)

    assert "Sweeper:\n      keeping up." in card
    assert (
        "Refused by the sweep, changed outside the ledger and waiting for an admin to "
        'restore them from their events: <a href="/invocations/inv-1/">inv-1</a>.'
    ) in card


def test_the_dashboard_shows_what_background_verification_found(
    api: Api, refund: Capability, operator: Client
) -> None:
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}")
    Invocation.objects.filter(invocation_id="inv-2").update(status="failed")

    assert "No whole pass yet." in dashboard_card(operator, "verification")
    assert "Verifier:\n      no pass yet." in dashboard_card(operator)
    assert verify_next_slice(invocations=1) is not None
    assert "Running for under a minute: 1 of 2 invocations checked so far." in dashboard_card(
        operator, "verification"
    )
    assert verify_next_slice(invocations=1) is not None
    found = dashboard_card(operator, "verification")
    assert (
        '<p class="behind">Last whole pass, finished under a minute ago: 2 invocations, '
        "2 events, 0 seals, 1 admin action and 1 capability,\n      1 break found:</p>"
    ) in found
    assert (
        "<li><code>projection broken at invocation inv-2 status: expected &#x27;recorded&#x27;, "
        'found &#x27;failed&#x27;</code> <a href="/invocations/inv-2/">its page</a></li>'
    ) in found
    assert "Verifier:\n      keeping up." in dashboard_card(operator)


def test_an_age_filter_too_large_for_a_date_is_refused_by_name(
    flagged: str, operator: Client
) -> None:
    """Found by fuzzing the console's GET forms: 10**20 minutes overflowed to a 500."""
    for path in ("/", "/queue/counts"):
        response = operator.get(path, {"older_than_minutes": "1" + "0" * 20})
        assert response.status_code == 200
    page = operator.get("/", {"older_than_minutes": "1" + "0" * 20}).content.decode()
    assert "older_than_minutes: Ensure this value is less than or equal to" in page
    assert "inv-1" not in page.split('id="queue-rows"')[1]


@pytest.mark.parametrize(
    "bad", [{"risk": "extreme"}, {"older_than_minutes": "an hour"}, {"cause": "gremlins"}]
)
def test_a_filter_that_does_not_parse_shows_nothing_but_the_error(
    flagged: str, operator: Client, bad: dict[str, str]
) -> None:
    """Never the whole queue under a filter the operator believes applied."""
    rows = operator.get("/", bad, headers={"HX-Request": "true"}).content.decode()
    (name,) = bad
    assert f"<li>{name}: " in rows and "inv-1" not in rows
    assert "Fix the filter above" in rows


def test_the_invocation_page_says_what_governed_it_when_its_intent_was_recorded(
    flagged: str, operator: Client
) -> None:
    capability_settings_change(
        scope="refund.create",
        actor="user:ada",
        reason="payments enforces the key atomically",
        idempotency_verified=True,
        max_attempts=2,
    )
    page = operator.get("/invocations/inv-1/").content.decode()
    assert (
        '<dd class="hints">not readonly; idempotency not verified; 1 of at most 5 attempts; '
        "outcome due 30000 ms after admission, flagged 60000 ms later"
    ) in page


def test_the_invocation_page_calls_a_capability_undeclared_only_as_the_api_does(
    flagged: str, api: Api, operator: Client
) -> None:
    registered = operator.get("/invocations/inv-1/").content.decode()
    assert (
        '<a href="/audit/capabilities/refund.create/">refund.create</a> (declaration v2, '
        "risk medium)"
    ) in registered
    # A row from before the registry made every capability from a declaration.
    Capability.objects.create(scope="legacy.tool")
    api.intent(invocation_id="inv-3", capability="legacy.tool", idempotency_key="k")
    legacy = operator.get("/invocations/inv-3/").content.decode()
    assert "legacy.tool</a> (registered without a declaration, risk medium)" in legacy
    status, state = api.intent(
        invocation_id="inv-2", capability="unknown.tool", idempotency_key="k"
    )
    assert (status, state["flags"]) == (201, ["undeclared"])
    undeclared = operator.get("/invocations/inv-2/").content.decode()
    assert "unknown.tool (undeclared, risk high)" in undeclared


def test_the_dashboard_counts_the_last_hours_shared_references(
    inv_2_names_rf_981: None, api: Api, compliance: Client
) -> None:
    assert '<p class="big">0</p>' in dashboard_card(
        compliance, "shared-references"
    )  # inv-2 was the first to name RF-981
    api.intent(invocation_id="inv-3", idempotency_key="key-3", attempt_id="a1")
    api.outcome("inv-3", "a1", kind="succeeded", business_reference="RF-981")
    card = dashboard_card(compliance, "shared-references")
    assert '<p class="big">1</p>' in card
    assert 'href="/audit/?flag=reference_shared"' in card


def test_the_dashboard_counts_every_status_at_most_once_a_minute(
    api: Api, refund: Capability, operator: Client, compliance: Client
) -> None:
    """Counting by status reads the whole invocation table: operators share one count
    a minute through the cache, and the page says when it was taken."""
    from django.core.cache import cache

    cache.delete("dashboard:by_status")
    api.intent(invocation_id="inv-1", idempotency_key="k-1")

    def by_status(client: Client) -> str:
        page = client.get("/dashboard/").content.decode()
        return page.split("<h2>By status</h2>")[1].split("</section>")[0]

    assert "<td>recorded</td><td>1</td>" in by_status(operator)
    api.intent(invocation_id="inv-2", idempotency_key="k-2")
    shared = by_status(compliance)  # within the minute: the same count
    assert "<td>recorded</td><td>1</td>" in shared and "counted at" in shared
    cache.delete("dashboard:by_status")  # as the minute runs out
    assert "<td>recorded</td><td>2</td>" in by_status(operator)


def references_section(page: bytes) -> str:
    return page.decode().split('<ul class="references">')[1].split("</ul>")[0]


def test_a_business_reference_on_two_invocations_is_shown_on_each(
    api: Api, refund: Capability, operator: Client
) -> None:
    for n, reference in ((1, "RF-981"), (2, "RF-981"), (3, "RF-7 & co")):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"key-{n}", attempt_id="a1")
        api.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference=reference)

    shared = references_section(operator.get("/invocations/inv-1/").content)
    alone = references_section(operator.get("/invocations/inv-3/").content)

    assert '<a href="/audit/?business_reference=RF-981"><code>RF-981</code></a>' in shared
    assert "named by the outcome" in shared and "Also named by 1 other invocation" in shared
    assert '<a href="/invocations/inv-2/">inv-2</a> (refund.create, succeeded)' in shared
    assert "inv-3" not in shared
    # The link carries the reference whole, however it is spelt.
    assert "?business_reference=RF-7%20%26%20co" in alone
    assert "No other invocation names it." in alone


def resolve_with(operator: Client, reference: str, **extra: str) -> Any:
    return operator.post(
        "/invocations/inv-1/resolve",
        {
            "effect": "effect_present",
            "business_reference": reference,
            "note": "found in the payments console",
            "seen_event_count": Invocation.objects.get(invocation_id="inv-1").event_count,
            **extra,
        },
    )


@pytest.fixture
def inv_2_names_rf_981(flagged: str, api: Api) -> None:
    names_rf_981(api)


@pytest.fixture
def high_risk_inv_2_names_rf_981(flagged_high_risk: str, api: Api) -> None:
    names_rf_981(api)


def names_rf_981(api: Api) -> None:
    api.intent(invocation_id="inv-2", idempotency_key="key-2", attempt_id="a1")
    api.outcome("inv-2", "a1", kind="succeeded", business_reference="RF-981")


def test_a_reference_another_invocation_names_must_be_confirmed(
    inv_2_names_rf_981: None, operator: Client
) -> None:
    """One effect must not be counted for two intents without a person saying so."""
    before = Invocation.objects.get(invocation_id="inv-1").event_count

    refused = resolve_with(operator, "RF-981")

    assert refused.status_code == 400
    page = refused.content.decode()
    assert "RF-981 is already named by inv-2." in page
    assert 'name="same_reference_confirmed"' in page
    invocation = Invocation.objects.get(invocation_id="inv-1")
    assert (invocation.status, invocation.event_count) == ("reconciliation_required", before)


def test_a_confirmed_shared_reference_resolves_and_is_recorded(
    inv_2_names_rf_981: None, operator: Client
) -> None:
    assert "references" not in operator.get("/invocations/inv-1/").content.decode()

    resolve_with(operator, "RF-981", same_reference_confirmed="on")

    invocation = Invocation.objects.get(invocation_id="inv-1")
    assert (invocation.status, invocation.flags) == ("succeeded", ["reference_shared"])
    assert invocation.events.get(kind="resolution").data["also_named_by"] == ["inv-2"]
    section = references_section(operator.get("/invocations/inv-1/").content)
    assert "named by the resolution" in section
    assert '<a href="/invocations/inv-2/">inv-2</a>' in section
    assert '<li class="shared">' in section


def approve_with(approver: Client, headers: dict[str, str] | None = None, **extra: str) -> Any:
    seen = Invocation.objects.get(invocation_id="inv-1").event_count
    return approver.post(
        "/invocations/inv-1/approve", {"seen_event_count": seen, **extra}, headers=headers
    )


@pytest.mark.parametrize("htmx", [False, True], ids=["page", "htmx"])
def test_an_approver_confirms_a_reference_named_elsewhere_since_the_proposal(
    flagged_high_risk: str, api: Api, operator: Client, htmx: bool
) -> None:
    """The proposal named RF-990 when no one else did; inv-2's success named it after.
    The approver is the person who counts the effect, so they are asked."""
    resolve_with(operator, "RF-990")
    api.intent(invocation_id="inv-2", idempotency_key="key-2", attempt_id="a1")
    api.outcome("inv-2", "a1", kind="succeeded", business_reference="RF-990")
    approver = person("amir", "approver")
    before = Invocation.objects.get(invocation_id="inv-1").event_count
    headers = {"HX-Request": "true"} if htmx else {}

    refused = approve_with(approver, headers=headers)

    assert refused.status_code == (200 if htmx else 400)
    page = refused.content.decode()
    assert "RF-990 is already named by inv-2." in page
    assert 'name="same_reference_confirmed"' in page
    invocation = Invocation.objects.get(invocation_id="inv-1")
    assert (invocation.status, invocation.event_count) == ("resolution_proposed", before)

    approve_with(approver, same_reference_confirmed="on")

    invocation = Invocation.objects.get(invocation_id="inv-1")
    assert (invocation.status, invocation.flags) == ("succeeded", ["reference_shared"])
    approved = invocation.events.get(kind="resolution_approved").data
    assert (approved["approved_by"], approved["also_named_by"]) == ("user:amir", ["inv-2"])


def test_a_reference_the_proposer_confirmed_is_not_asked_again(
    high_risk_inv_2_names_rf_981: None, operator: Client
) -> None:
    resolve_with(operator, "RF-981", same_reference_confirmed="on")
    assert Invocation.objects.get(invocation_id="inv-1").status == "resolution_proposed"

    approve_with(person("amir", "approver"))

    invocation = Invocation.objects.get(invocation_id="inv-1")
    assert (invocation.status, invocation.flags) == ("succeeded", ["reference_shared"])
    approved = invocation.events.get(kind="resolution_approved").data
    assert approved["also_named_by"] == ["inv-2"]


def test_another_runtimes_invocation_is_shown_to_people_but_recorded_only_as_a_number(
    flagged: str, api: Api, api_b: Api, operator: Client
) -> None:
    """The operator sees and confirms against runtime B's invocation by name; inv-1's
    event, which runtime A reads, records only that one other runtime's names it."""
    api_b.intent(invocation_id="b-order-17", idempotency_key="key-2", attempt_id="a1")
    api_b.outcome("b-order-17", "a1", kind="succeeded", business_reference="RF-983")

    refused = resolve_with(operator, "RF-983")
    assert "RF-983 is already named by b-order-17." in refused.content.decode()
    resolve_with(operator, "RF-983", same_reference_confirmed="on")

    resolution = Invocation.objects.get(invocation_id="inv-1").events.get(kind="resolution")
    assert resolution.data["also_named_elsewhere"] == 1
    assert "also_named_by" not in resolution.data
    status, detail = api.get("/api/v1/invocations/inv-1")
    assert (status, detail["flags"]) == (200, ["reference_shared"])
    assert "order-17" not in json.dumps(detail)
    assert "b-order-17" in references_section(operator.get("/invocations/inv-1/").content)


@pytest.mark.parametrize("b_names_it", ["before the proposal", "after the proposal"])
def test_an_approver_is_asked_only_when_another_runtime_has_come_to_name_the_reference(
    high_risk_inv_2_names_rf_981: None, api_b: Api, operator: Client, b_names_it: str
) -> None:
    """The proposal records runtime B's invocations only as a number; a larger number
    at approval means one named the reference since, and the approver is asked."""

    def b_names_rf_981() -> None:
        api_b.intent(invocation_id="b-1", idempotency_key="key-b", attempt_id="a1")
        api_b.outcome("b-1", "a1", kind="succeeded", business_reference="RF-981")

    if b_names_it == "before the proposal":
        b_names_rf_981()
    resolve_with(operator, "RF-981", same_reference_confirmed="on")
    if b_names_it == "after the proposal":
        b_names_rf_981()
    approver = person("amir", "approver")

    first = approve_with(approver)

    invocation = Invocation.objects.get(invocation_id="inv-1")
    if b_names_it == "after the proposal":
        assert "RF-981 is already named by b-1." in first.content.decode()
        assert invocation.status == "resolution_proposed"
        approve_with(approver, same_reference_confirmed="on")
        invocation = Invocation.objects.get(invocation_id="inv-1")
    assert invocation.status == "succeeded"
    approved = invocation.events.get(kind="resolution_approved").data
    assert (approved["also_named_by"], approved["also_named_elsewhere"]) == (["inv-2"], 1)


def test_a_reference_no_other_invocation_names_needs_no_confirmation(
    inv_2_names_rf_981: None, operator: Client
) -> None:
    resolve_with(operator, "RF-982")

    invocation = Invocation.objects.get(invocation_id="inv-1")
    assert (invocation.status, invocation.flags) == ("succeeded", [])
    assert "also_named_by" not in invocation.events.get(kind="resolution").data


def test_a_reference_only_a_conflicting_claim_names_is_linked_and_confirmed(
    flagged: str, api: Api, operator: Client
) -> None:
    """A runtime that claims, too late, an effect under a reference another outcome
    already settled is evidence of that reference all the same."""
    api.intent(invocation_id="inv-2", idempotency_key="key-2", attempt_id="a1")
    api.outcome("inv-2", "a1", kind="succeeded", business_reference="RF-980")
    status, _ = api.outcome("inv-2", "a1", kind="succeeded", business_reference="RF-981")
    assert status == 409

    section = references_section(operator.get("/invocations/inv-2/").content)
    found = operator.get("/audit/", {"business_reference": "RF-981"}).content.decode()
    refused = resolve_with(operator, "RF-981")

    rf_981 = next(item for item in section.split("<li")[1:] if "RF-981" in item)
    assert "named by the conflicting outcome claim." in rf_981
    assert re.findall(r'href="/invocations/(inv-\d)/"', found) == ["inv-2"]
    assert refused.status_code == 400
    assert "RF-981 is already named by inv-2." in refused.content.decode()


def test_the_audit_search_by_reference_lists_every_invocation_naming_it(
    api: Api, refund: Capability, operator: Client
) -> None:
    for n in range(1, 4):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"key-{n}", attempt_id="a1")
        api.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference=f"RF-{n % 2}")

    page = operator.get("/audit/", {"business_reference": "RF-1"}).content.decode()

    assert re.findall(r'href="/invocations/(inv-\d)/"', page) == ["inv-3", "inv-1"]


@pytest.fixture
def escalated_for_want_of_a_probe(api: Api, refund: Capability, standin: StandInService) -> None:
    """inv-a (refunded), inv-b (not) and inv-c (refunded, olga's colleague on it),
    escalated while refund.create had no probe; then an admin gave it one."""
    for invocation_id in ("inv-a", "inv-b", "inv-c"):
        reported_lost(api, invocation_id)
        reconcile_invocation.run(invocation_id)
        assert Invocation.objects.get(invocation_id=invocation_id).cause == "no_probe"
    perform_refund(standin, "k-inv-a")
    perform_refund(standin, "k-inv-c")
    invocation_assign(invocation_id="inv-c", actor="user:petra", take=True)
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="payments can be asked now",
        probe=standin.probe_config(),
    )  # fmt: skip


def probe_requests(invocation_id: str) -> list[tuple[str, Any]]:
    events = Invocation.objects.get(invocation_id=invocation_id).events
    return [(e.actor, e.data.get("every_of")) for e in events.filter(kind="probe_requested")]


def test_an_operator_reruns_the_probes_a_capability_was_given_for_its_escalated_invocations(
    escalated_for_want_of_a_probe: None,
    operator: Client,
    compliance: Client,
    broker_queue: BrokerQueue,
) -> None:
    page = operator.get("/", {"capability": "refund.create"}).content.decode()
    assert "2 escalated invocations of refund.create that nobody is on" in page
    its_page = compliance.get("/audit/capabilities/refund.create/").content.decode()
    assert "2 escalated invocations that nobody is on could be settled by it now" in its_page
    assert 'id="probe-problems"' not in its_page
    assert 'href="/?capability=refund.create">re-run their probes from the queue' in its_page
    assert (
        "Re-run their probes" not in compliance.get("/?capability=refund.create").content.decode()
    )
    assert "Re-run their probes" not in operator.get("/").content.decode()  # no capability named

    answer = operator.post("/queue/probes", {"capability": "refund.create"}, follow=True)

    assert "Probes requested for the 2 escalated invocations of refund.create" in (
        answer.content.decode()
    )
    assert answer.redirect_chain[-1][0] == "/?capability=refund.create"
    assert broker_queue.jobs() == 1  # the request: a worker records and queues each probe
    again = person("petra", "operator").post(
        "/queue/probes", {"capability": "refund.create"}, follow=True
    )
    assert "user:olga asked for these probes a moment ago" in again.content.decode()
    assert broker_queue.jobs() == 1
    offer = operator.get("/", {"capability": "refund.create"}).content.decode()
    assert "user:olga asked for their probes a moment ago." in offer
    assert "Re-run their probes" not in offer
    assert request_probes.run("refund.create", "user:olga") == 2
    assert broker_queue.jobs() == 3
    assert probe_requests("inv-a") == probe_requests("inv-b") == [("user:olga", "refund.create")]
    assert probe_requests("inv-c") == []  # petra is on it
    timeline = operator.get("/invocations/inv-a/").content.decode()
    assert "(with every escalation of refund.create its probe could settle)" in timeline
    action_log = compliance.get("/audit/actions/").content.decode()
    assert action_log.count("with every escalation of refund.create its probe could") == 1
    assert "2 invocations, " in action_log
    for invocation_id in ("inv-a", "inv-b"):
        reconcile_invocation.run(invocation_id, force=True)
    assert status_of("inv-a") == "succeeded" and status_of("inv-b") == "retry_allowed"
    assert status_of("inv-c") == "escalated"
    assert "Re-run their probes" not in operator.get("/?capability=refund.create").content.decode()
    its_page = compliance.get("/audit/capabilities/refund.create/").content.decode()
    assert "could be settled by it now" not in its_page


def test_the_action_log_gives_a_rerun_one_line_and_drops_no_action(
    api: Api, refund: Capability, standin: StandInService
) -> None:
    """A re-run of a capability's probes acts on every escalation it could settle, each
    with an event: the log says so once, not once for each, whatever the size of its
    pages, and every other action keeps its line."""
    for n in range(8):
        reported_lost(api, f"inv-{n}")
        reconcile_invocation.run(f"inv-{n}")
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="payments can be asked now",
        probe=standin.probe_config(),
    )  # fmt: skip
    invocation_assign(invocation_id="inv-0", actor="user:olga", take=True)
    invocation_assign(invocation_id="inv-0", actor="user:olga", take=False)
    # One invocation's probe, asked for on its page: a line of its own, next to the run.
    probe_requested(invocation_id="inv-7", actor="user:olga", queued=True)
    for batch in (["inv-1", "inv-2"], ["inv-3", "inv-4"], ["inv-5", "inv-6"]):
        probes_requested(capability=refund, invocation_ids=batch, actor="user:olga")
    # Asked again a minute later, for one escalated again meanwhile: the same line.
    probes_requested(capability=refund, invocation_ids=["inv-1"], actor="user:olga")
    invocation_assign(invocation_id="inv-7", actor="user:petra", take=True)

    page = person("cora", "compliance").get("/audit/actions/").content.decode()
    rows = re.findall(r"<tr><td>.*?</tr>", page, re.S)[:4]
    cells = [re.findall(r"<td>(.*?)</td>", row, re.S) for row in rows]
    assert [[re.sub(r"<[^>]+>", "", cell).split()[0] for cell in row[1:4]] for row in cells] == [
        ["user:petra", "assigned", "inv-7"],
        ["user:olga", "probe_requested", "6"],
        ["user:olga", "probe_requested", "inv-7"],
        ["user:olga", "unassigned", "inv-0"],
    ]
    assert "6 invocations (7 requests), " in page
    assert 'href="/invocations/inv-1/">inv-1</a> … <a href="/invocations/inv-1/">' in page
    assert "?operator=olga&amp;capability=refund.create" in page

    people = Event.objects.filter(actor__startswith="user:").select_related("invocation")
    total = people.count()
    for lines in (1, 2, 3):
        seen, before, pages = [], None, 0
        while True:
            found, before = audit.action_lines(people, before=before, lines=lines)
            seen += [(line.newest.pk, line.oldest.pk, line.count) for line in found]
            pages += 1
            assert len(found) <= lines and pages < 20
            if before is None:
                break
        assert sum(count for *_, count in seen) == total  # every event, on one line each
        newest_first = [pk for newest, oldest, _ in seen for pk in (newest, oldest)]
        assert newest_first == sorted(newest_first, reverse=True)
        assert [count for *_, count in seen] == [1, 7, 1, 1, 1]


def test_probes_are_not_rerun_for_whom_none_may_settle(
    escalated_for_want_of_a_probe: None,
    api: Api,
    operator: Client,
    compliance: Client,
    broker_queue: BrokerQueue,
) -> None:
    reported_lost(api, "inv-undeclared", capability="payroll.update")
    reconcile_invocation.run("inv-undeclared")
    registered("payroll.update", settings={"probe": {"kind": "none"}})
    events = Event.objects.count()

    assert compliance.post("/queue/probes", {"capability": "refund.create"}).status_code == 403
    for scope, said in (
        ("payroll.update", "payroll.update has no probe to run."),
        ("nothing.here", "nothing.here has no probe to run."),
        ("", "Name the capability whose probes should run again."),
    ):
        answer = operator.post("/queue/probes", {"capability": scope}, follow=True)
        assert said in answer.content.decode(), scope
    assert broker_queue.jobs() == 0
    assert Event.objects.count() == events


def test_probes_the_broker_cannot_take_are_reported_and_nothing_recorded(
    escalated_for_want_of_a_probe: None, operator: Client, broker_down: None
) -> None:
    events = Event.objects.count()
    answer = operator.post("/queue/probes", {"capability": "refund.create"}, follow=True)
    assert answer.status_code == 200
    assert "The probes are not queued: the task broker is unreachable." in answer.content.decode()
    assert Event.objects.count() == events


def test_the_escalated_a_probe_could_settle_are_counted_so_far_only(
    escalated_for_want_of_a_probe: None, operator: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an outage a capability's escalations run to the hundred thousand: the
    queue's page says "or more" rather than count them all."""
    monkeypatch.setattr(capabilities, "PROBES_COUNTED", 1)
    page = operator.get("/", {"capability": "refund.create"}).content.decode()
    assert "1 or more escalated invocations of refund.create that nobody is on" in page


def test_the_offer_reads_only_the_escalations_a_probe_could_settle(
    escalated_for_want_of_a_probe: None, api: Api, refund: Capability
) -> None:
    """From their own index: the capability's other flagged invocations, as many as an
    outage leaves, are not read to count them."""
    for n in range(6):
        reported_lost(api, f"inv-waiting-{n}")  # reconciliation_required, never probed

    waiting, rows_read = invocation_rows_read(lambda: capabilities.awaiting_its_probe(refund))

    assert (waiting, rows_read) == ("2 escalated invocations", 2)


def test_an_invocation_recorded_undeclared_is_probed_once_its_scope_has_a_probe(
    api: Api, standin: StandInService, operator: Client, broker_queue: BrokerQueue
) -> None:
    """A runtime called payroll.update before anyone declared it, and lost the outcome:
    people had it. Declared since with a probe, the probe asks for it too; the
    invocation keeps the flag and the conservative hints it was recorded with."""
    reported_lost(api, "inv-u", capability="payroll.update")
    perform_refund(standin, "k-inv-u")
    reconcile_invocation.run("inv-u")
    assert Invocation.objects.get().cause == "no_probe"
    registered("payroll.update", settings={"probe": standin.probe_config()})

    queue = operator.get("/", {"capability": "payroll.update"}).content.decode()
    assert "1 escalated invocation of payroll.update that nobody is on" in queue
    assert "Re-run probe now" in operator.get("/invocations/inv-u/").content.decode()
    assert request_probes.run("payroll.update", "user:olga") == 1
    reconcile_invocation.run("inv-u", force=True)

    settled = Invocation.objects.get()
    assert (settled.status, settled.flags) == ("succeeded", ["undeclared"])
    assert settled.capability_id is None and settled.hint_readonly is False


def test_a_rerun_goes_a_batch_at_a_time_each_run_queuing_the_next(
    escalated_for_want_of_a_probe: None, broker_queue: BrokerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker is held for a batch, not for every escalation of a capability."""
    monkeypatch.setattr(tasks, "REQUEST_BATCH", 1)
    a, b = (Invocation.objects.get(invocation_id=i).pk for i in ("inv-a", "inv-b"))

    assert request_probes.run("refund.create", "user:olga") == 1
    assert broker_queue.jobs() == 2  # inv-a's probe, and the run for the rest
    assert probe_requests("inv-a") == [("user:olga", "refund.create")]
    assert probe_requests("inv-b") == []
    assert request_probes.run("refund.create", "user:olga", after=a) == 1
    assert broker_queue.jobs() == 4
    assert request_probes.run("refund.create", "user:olga", after=b) == 0  # petra's inv-c
    assert broker_queue.jobs() == 4
    assert probe_requests("inv-b") == [("user:olga", "refund.create")]


def test_an_operator_asks_a_capabilitys_probe_about_a_key_and_nothing_is_recorded(
    api: Api,
    refunds: Capability,
    standin: StandInService,
    operator: Client,
    compliance: Client,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before a probe settles real invocations, whoever wrote it asks it about a refund
    they know of and a key that has none, and reads what its rules conclude."""
    refund = perform_refund(standin, "k-known").json()
    flag(api)  # one invocation on the record, which the tries must leave alone
    events = Event.objects.count()
    its_page = operator.get("/audit/capabilities/refund.create/").content.decode()
    assert 'action="/audit/capabilities/refund.create/probe-try"' in its_page
    assert "probe-try" not in compliance.get("/audit/capabilities/refund.create/").content.decode()

    known = operator.post(
        "/audit/capabilities/refund.create/probe-try",
        {"idempotency_key": "k-known"},
        headers={"HX-Request": "true"},
    ).content.decode()
    unknown = operator.post(
        "/audit/capabilities/refund.create/probe-try", {"idempotency_key": "k-never"}
    ).content.decode()

    assert known.lstrip().startswith('<div id="probe-try-result"')  # the partial, for htmx
    assert f"<strong>effect_present</strong>, business reference {refund['id']}" in known
    assert "refunds?idempotency_key=k-known</code>" in known
    assert "<h1>Try the probe of refund.create</h1>" in unknown  # the page, without htmx
    assert "<strong>effect_absent</strong>" in unknown
    assert "<dd>404 — absent rule: error = &quot;refund_not_found&quot;</dd>" in unknown
    assert Event.objects.count() == events
    assert status_of("inv-1") == "reconciliation_required"
    # Who asked the business system about which key is in the log, not on the record.
    assert (
        "probe tried capability=refund.create key='k-known' by=user:olga finding=effect_present"
        in (caplog.text)
    )
    refused = compliance.post(
        "/audit/capabilities/refund.create/probe-try", {"idempotency_key": "k-known"}
    )
    assert refused.status_code == 403


def test_trying_a_probe_names_what_cannot_be_tried(
    api: Api, refunds: Capability, operator: Client
) -> None:
    url = "/audit/capabilities/refund.create/probe-try"
    bad_key = operator.post(url, {"idempotency_key": "k\x07"}).content.decode()
    assert "<li>idempotency key: No control characters.</li>" in bad_key
    Capability.objects.filter(pk=refunds.pk).update(probe={"kind": "none"})
    assert "probe-try" not in operator.get("/audit/capabilities/refund.create/").content.decode()
    no_probe = operator.post(url, {"idempotency_key": "k-1"}).content.decode()
    assert "This capability has no probe to try" in no_probe


def test_a_python_probe_is_tried_as_long_as_a_person_waits(
    refunds: Capability, operator: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A python probe is asked about the key as an http probe is. One that does not
    answer while a person waits is said to run on, and only so many run at once in a
    web process (two here), however often one that never returns is tried."""
    url = "/audit/capabilities/refund.create/probe-try"
    finds, hangs = f"{__name__}.finds_by_key", f"{__name__}.hangs"
    settings.LEDGER_PYTHON_PROBES = [finds, hangs]
    Capability.objects.filter(pk=refunds.pk).update(probe={"kind": "python", "callable": finds})
    assert f'action="{url}"' in operator.get("/audit/capabilities/refund.create/").content.decode()
    found = operator.post(url, {"idempotency_key": "k-known"}).content.decode()
    assert "<strong>effect_present</strong>, business reference RF-k-known" in found
    assert f"<code>{finds}</code>, with the capability and the key alone" in found

    Capability.objects.filter(pk=refunds.pk).update(probe={"kind": "python", "callable": hangs})
    monkeypatch.setattr(services, "PROBE_TRY_WAIT_SECONDS", 0.2)
    monkeypatch.setattr(probes, "PYTHON_PROBES_AT_ONCE", 2)
    monkeypatch.setattr(probes, "_python_slots", threading.BoundedSemaphore(2))
    HANGING.clear()
    try:
        tries = [
            operator.post(url, {"idempotency_key": f"k-{n}"}).content.decode() for n in range(3)
        ]
    finally:
        HANGING.set()
    assert ["no answer within 0.2 s; the probe runs on, unwatched" in page for page in tries] == [
        True,
        True,
        False,
    ]
    assert "not started: 2 python probes still run in this process" in tries[2]
    wait_for(lambda: not any(thread.name == "python-probe" for thread in threading.enumerate()))
    again = operator.post(url, {"idempotency_key": "k-3"}).content.decode()
    assert "<strong>inconclusive</strong>" in again and "still run" not in again


def finds_by_key(invocation: Invocation) -> ProbeResult:
    return ProbeResult(Finding.PRESENT, business_reference=f"RF-{invocation.idempotency_key}")


HANGING = threading.Event()


def hangs(invocation: Invocation) -> ProbeResult:
    """Answers once HANGING is set (at once, then), as a business system that is back."""
    HANGING.wait(timeout=60)
    return ProbeResult(Finding.INCONCLUSIVE, detail="the business system is back")
