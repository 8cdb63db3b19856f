"""A declared `execution.rate_limit` enforced at admission, for the capabilities whose
`rate_limit_enforced` setting is on: the attempt beyond it is refused (429), and
nothing of its request is recorded."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from ledger.capabilities import SETTINGS_CHANGED, capability_settings_change
from ledger.integrity import seal_events, verify
from ledger.models import (
    AdminAction,
    Attempt,
    Capability,
    Event,
    Invocation,
    RateAdmission,
    Runtime,
    RuntimeToken,
)
from ledger.rate_enforcement import RateLimit, Room
from ledger.rate_limits import watch_rate_limits
from tests.conftest import Api, person, registered
from tests.ledger.conftest import ledger_clock_at, superuser_sql
from tests.ledger.test_concurrency import race


def enforced(count: int = 2, window: str = "1h", scope: str = "refund.create") -> Capability:
    registered(scope, rate_limit={"count": count, "window": window})
    capability_settings_change(
        scope=scope, actor="user:ada", reason="payments allows 2 an hour", rate_limit_enforced=True
    )
    return Capability.objects.get(scope=scope)


def intent(api: Api, n: int, scope: str = "refund.create") -> tuple[int, dict]:
    return api.intent(
        invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", capability=scope, attempt_id="a1"
    )


def test_the_attempt_beyond_the_limit_is_refused_with_when_to_ask_again(
    api: Api, db: None, caplog: pytest.LogCaptureFixture
) -> None:
    enforced(count=2, window="1h")
    assert [intent(api, n)[0] for n in (1, 2)] == [201, 201]
    response = api.client.post(
        "/api/v1/intents",
        json.dumps({"invocation_id": "inv-3", "task_id": "t", "capability": "refund.create",
                    "arguments": {}, "idempotency_key": "k-3", "attempt_id": "a1"}),
        content_type="application/json", headers=api.headers(),
    )  # fmt: skip
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["type"] == "rate_limited"
    assert error["message"].startswith("refund.create admits at most 2 attempts per 1h")
    assert error["details"]["capability"] == "refund.create"
    assert error["details"]["rate_limit"] == {"count": 2, "window": "1h"}
    # The oldest of the two leaves the window in an hour, less the time the test took.
    assert 3500 < error["details"]["retry_after_seconds"] <= 3600
    assert response["Retry-After"] == str(error["details"]["retry_after_seconds"])
    # Nothing of the refused request was recorded, not even its intent.
    assert not Invocation.objects.filter(invocation_id="inv-3").exists()
    assert Attempt.objects.count() == 2
    assert RateAdmission.objects.count() == 2
    # The log says whose limit refused whom: the access log says only 429.
    refusals = [message for message in caplog.messages if message.startswith("rate limited")]
    assert refusals == ["rate limited runtime=runtime-a capability=refund.create refused=1"]


def test_an_admission_is_judged_by_the_one_count_numbers_before_it() -> None:
    """Two a minute: the third admission reads the first; a limit of a million reads
    one row all the same."""
    t0 = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.UTC)
    limit = RateLimit(count=2, window=dt.timedelta(minutes=1), declared={})
    room = Room("refund.create", limit, next=3, earlier={1: t0})
    assert room.full(t0 + dt.timedelta(seconds=59))
    assert room.refusal(t0 + dt.timedelta(seconds=59))["retry_after_seconds"] == 1
    assert not room.full(t0 + dt.timedelta(seconds=60))  # the window is (now - 1m, now]
    assert room.take(t0 + dt.timedelta(seconds=60), "inv-3", "a1") == 3
    assert not room.full(t0 + dt.timedelta(seconds=60))  # the fourth reads the second: none
    fresh = Room("refund.create", limit, next=1, earlier={})
    assert not fresh.full(t0)


def test_only_the_newest_count_admissions_are_kept(api: Api, db: None) -> None:
    enforced(count=2, window="1m")
    for n in (1, 2):
        assert intent(api, n)[0] == 201
    RateAdmission.objects.update(admitted_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=2))
    for n in (3, 4):
        assert intent(api, n)[0] == 201
    kept = RateAdmission.objects.order_by("number").values_list("number", "invocation_id")
    assert list(kept) == [(3, "inv-3"), (4, "inv-4")]


def test_a_retry_counts_and_is_refused_like_a_first_attempt(api: Api, db: None) -> None:
    enforced(count=2)
    intent(api, 1)
    api.outcome("inv-1", "a1", kind="pre_dispatch_rejected")
    assert api.attempt("inv-1", "a2")[0] == 201
    status, body = api.attempt("inv-1", "a3")  # a policy refusal comes first, as ever
    assert (status, body["error"]["type"]) == (409, "attempt_in_flight")
    api.outcome("inv-1", "a2", kind="pre_dispatch_rejected")
    status, body = api.attempt("inv-1", "a3")
    assert (status, body["error"]["type"]) == (429, "rate_limited")
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.attempt_count) == ("retry_allowed", 2)
    # A replay of an admitted attempt is answered as ever: it is no new admission.
    assert api.attempt("inv-1", "a2")[0] == 200


def test_the_window_slides_and_every_runtime_counts(api: Api, api_b: Api, db: None) -> None:
    enforced(count=2, window="1m")
    assert intent(api, 1)[0] == 201
    assert intent(api_b, 2)[0] == 201
    assert intent(api, 3)[0] == 429
    # The first admission, moved a minute back, has left the window; the second has not.
    RateAdmission.objects.filter(invocation_id="inv-1").update(
        admitted_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=61)
    )
    assert intent(api, 3)[0] == 201
    assert intent(api, 4)[0] == 429


def test_a_batch_is_refused_item_by_item_past_the_limit(
    api: Api, db: None, caplog: pytest.LogCaptureFixture
) -> None:
    enforced(count=2)
    registered("order.read", readonly=True)
    items = [
        {"type": "intent", "invocation_id": f"inv-{n}", "task_id": "t", "capability": scope,
         "arguments": {}, "idempotency_key": f"k-{n}", "attempt_id": "a1"}
        for n, scope in enumerate(["refund.create", "order.read", "refund.create",
                                   "refund.create", "order.read"])
    ]  # fmt: skip
    status, body = api.post("/api/v1/evidence", items)
    assert status == 207
    assert [result["status"] for result in body["results"]] == [201, 201, 201, 429, 201]
    assert "rate limited runtime=runtime-a capability=refund.create refused=1" in caplog.messages
    assert body["results"][3]["body"]["error"]["type"] == "rate_limited"
    assert sorted(Invocation.objects.values_list("invocation_id", flat=True)) == [
        "inv-0", "inv-1", "inv-2", "inv-4",
    ]  # fmt: skip


def test_turned_on_it_counts_from_then_whatever_the_web_process_remembered(
    api: Api, db: None
) -> None:
    """The process remembers the capability as it read it, not enforced: the write
    finds it changed, and the intent is read and applied again, under the limit."""
    registered("refund.create", rate_limit={"count": 1, "window": "1h"})
    assert [intent(api, n)[0] for n in (1, 2)] == [201, 201]  # remembered as it is
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="now", rate_limit_enforced=True
    )
    assert intent(api, 3)[0] == 429
    assert list(RateAdmission.objects.values_list("invocation_id", flat=True)) == ["inv-2"]


def test_admissions_made_before_it_was_turned_on_count_against_its_first_window(
    api: Api, db: None
) -> None:
    """Turned on mid-window, the limit counts the admissions already made in the window,
    the newest `count` of them, read from the evidence: not up to twice the limit."""
    registered("refund.create", rate_limit={"count": 3, "window": "1h"})
    now = dt.datetime.now(dt.UTC)
    with ledger_clock_at(now - dt.timedelta(minutes=61)):
        assert intent(api, 1)[0] == 201  # out of the window by the time it is turned on
    with ledger_clock_at(now - dt.timedelta(minutes=30)):
        assert [intent(api, n)[0] for n in (2, 3)] == [201, 201]
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="now", rate_limit_enforced=True
    )
    kept = RateAdmission.objects.order_by("number").values_list("number", "invocation_id")
    assert list(kept) == [(1, "inv-2"), (2, "inv-3")]
    assert intent(api, 4)[0] == 201
    status, body = intent(api, 5)
    assert (status, body["error"]["type"]) == (429, "rate_limited")
    # Counted against inv-2, which leaves the window half an hour from now.
    assert 1700 < body["error"]["details"]["retry_after_seconds"] <= 1800


def test_turned_off_it_keeps_no_numbers_and_turned_on_again_counts_what_it_missed(
    api: Api, db: None
) -> None:
    enforced(count=2, window="1h")
    assert intent(api, 1)[0] == 201
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="off", rate_limit_enforced=False
    )
    assert not RateAdmission.objects.exists()
    assert intent(api, 2)[0] == 201  # not numbered: nothing is enforced
    assert not RateAdmission.objects.exists()
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="on", rate_limit_enforced=True
    )
    assert intent(api, 3)[0] == 429


def test_a_new_declaration_is_judged_by_the_admissions_in_its_own_window(
    api: Api, db: None
) -> None:
    """Once a minute, then twice an hour: the admissions kept for the old limit (its
    newest one) would not show the two already made in the last hour."""
    enforced(count=1, window="1m")
    now = dt.datetime.now(dt.UTC)
    for n, minutes_ago in [(1, 10), (2, 5)]:
        with ledger_clock_at(now - dt.timedelta(minutes=minutes_ago)):
            assert intent(api, n)[0] == 201
    assert list(RateAdmission.objects.values_list("invocation_id", flat=True)) == ["inv-2"]
    registered("refund.create", rate_limit={"count": 2, "window": "1h"})
    assert intent(api, 3)[0] == 429
    kept = RateAdmission.objects.order_by("number").values_list("number", "invocation_id")
    assert list(kept) == [(1, "inv-1"), (2, "inv-2")]


def test_capabilities_not_enforced_take_no_lock_and_read_no_count(api: Api, db: None) -> None:
    """Declared but not enforced (the default): admitted, and flagged by the watch; the
    request neither takes the capability's lock nor reads its admissions."""
    registered("refund.create", rate_limit={"count": 1, "window": "1h"})
    assert intent(api, 1)[0] == 201  # (which also reads the capability, if remembered)
    with CaptureQueriesContext(connection) as queries:
        assert intent(api, 2)[0] == 201
    read = " ".join(query["sql"] for query in queries.captured_queries)
    assert "ledger.rate_limit:" not in read and "ledger_rateadmission" not in read
    assert not RateAdmission.objects.exists()
    seal_events()
    assert watch_rate_limits().flagged == ["inv-2"]


def test_what_it_admits_the_watch_never_finds_beyond_the_limit(api: Api, db: None) -> None:
    enforced(count=2)
    for n in range(5):
        intent(api, n)
    seal_events()
    watched = watch_rate_limits()
    assert (watched.admissions, watched.breaches) == (2, 0)


def test_turning_it_on_is_a_recorded_setting_and_a_change_outside_the_registry_is_found(
    db: None,
) -> None:
    enforced()
    assert verify().ok
    superuser_sql("UPDATE ledger_capability SET rate_limit_enforced = false")
    breaks = [(b.where, b.expected, b.found) for b in verify().breaks]
    assert breaks == [
        ("capability refund.create", "rate_limit_enforced true", "rate_limit_enforced false")
    ]


def test_a_settings_change_recorded_before_the_setting_existed_verifies(db: None) -> None:
    """Its record names the settings there were then: the new one was at its default."""
    registered("refund.create")
    before: dict[str, object] = {
        "idempotency_verified": False, "max_attempts": 3, "grace_ms": None,
        "redact_paths": [], "probe": {},
    }  # fmt: skip
    AdminAction.record(
        actor="user:ada", action=SETTINGS_CHANGED, target="refund.create", reason="then",
        details={"changed": {"max_attempts": {"from": None, "to": 3}}, "settings": before},
    )  # fmt: skip
    Capability.objects.filter(scope="refund.create").update(max_attempts=3)
    assert verify().ok
    superuser_sql("UPDATE ledger_capability SET rate_limit_enforced = true")
    assert [b.found for b in verify().breaks] == ["rate_limit_enforced true"]


def test_the_capability_page_says_whether_it_is_enforced_and_how_full_it_is(
    api: Api, db: None
) -> None:
    enforced(count=2, window="1h")
    assert intent(api, 1)[0] == 201
    reviewer = person("carl", "compliance")
    page = reviewer.get("/audit/capabilities/refund.create/").content.decode()
    assert "2 per 1h, as declared: enforced, an attempt beyond it refused at admission" in page
    assert "nothing recorded), 1 of 2 admitted in the last 1h;" in page
    listed = reviewer.get("/audit/capabilities/").content.decode()
    assert "<td>2 per 1h, enforced</td>" in listed


@pytest.mark.django_db(transaction=True)
def test_of_ten_concurrent_admissions_under_a_limit_of_three_three_are_admitted() -> None:
    """Ten runtimes' intents at once, on ten connections: the capability's lock lets
    them count one after the other."""
    enforced(count=3)
    tokens = [
        RuntimeToken.issue(runtime=Runtime.objects.create(name=f"racer-{n}"))[1] for n in range(10)
    ]
    results = race(10, lambda n: intent(Api(Client(), tokens[n]), n))
    assert Counter(status for status, _ in results) == {201: 3, 429: 7}
    assert Invocation.objects.count() == Attempt.objects.count() == 3
    assert Event.objects.filter(kind="attempt_admitted").count() == 3


TURNED_ON = {
    "idempotency_verified": "", "max_attempts": "", "grace_ms": "", "redact_paths": "",
    "probe": "{}", "rate_limit_enforced": "on",
    "declarations-TOTAL_FORMS": 0, "declarations-INITIAL_FORMS": 0,
}  # fmt: skip


def test_an_admin_turns_it_on_in_the_admin_says_why_and_is_told_how_full_it_is(
    admin_client: Client, api: Api
) -> None:
    capability = registered("refund.create", rate_limit={"count": 2, "window": "1h"})
    assert intent(api, 1)[0] == 201
    url = f"/admin/ledger/capability/{capability.pk}/change/"
    refused = admin_client.post(url, TURNED_ON).content.decode()
    assert "Say why rate_limit_enforced change" in refused
    saved = admin_client.post(url, TURNED_ON | {"reason": "payments allows 2 an hour"}, follow=True)
    assert saved.redirect_chain[0][1] == 302
    told = [str(message) for message in saved.context["messages"]]
    assert "Enforced from now: 1 of 2 admissions in the last 1h were made already" in told[0]
    capability.refresh_from_db()
    assert capability.rate_limit_enforced
    change = AdminAction.objects.get(action=SETTINGS_CHANGED)
    assert change.details["changed"] == {"rate_limit_enforced": {"from": False, "to": True}}
    assert change.reason == "payments allows 2 an hour"


def test_turned_on_over_a_full_window_the_admin_is_warned_that_it_is_full(
    admin_client: Client, api: Api
) -> None:
    capability = registered("refund.create", rate_limit={"count": 2, "window": "1h"})
    for n in (1, 2, 3):
        assert intent(api, n)[0] == 201
    url = f"/admin/ledger/capability/{capability.pk}/change/"
    saved = admin_client.post(url, TURNED_ON | {"reason": "a runaway agent"}, follow=True)
    told = [(message.level_tag, str(message)) for message in saved.context["messages"]]
    assert told[0] == (
        "warning",
        "Enforced from now: 2 or more admissions were made in the last 1h, so its window is "
        "full: the next is refused until the oldest of them leaves it.",
    )
    assert intent(api, 4)[0] == 429


def test_turned_on_for_a_capability_that_declares_no_limit_the_admin_is_warned(
    admin_client: Client,
) -> None:
    capability = registered("refund.create")
    url = f"/admin/ledger/capability/{capability.pk}/change/"
    saved = admin_client.post(url, TURNED_ON | {"reason": "before the declaration"}, follow=True)
    told = [(message.level_tag, str(message)) for message in saved.context["messages"]]
    assert (
        "warning",
        "Its declaration declares no execution.rate_limit: nothing is enforced until a "
        "declaration that does is registered.",
    ) in told
