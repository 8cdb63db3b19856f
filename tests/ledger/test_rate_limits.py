"""The rate-limit watch: attempts admitted beyond a capability's declared
`execution.rate_limit` flag their invocations, once, from the sealed events."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pytest

from ledger import rate_limits
from ledger.integrity import restore_projection, seal_events, verify
from ledger.models import Capability, Event, Invocation, RateWatch
from ledger.rate_limits import Admission, RateLimit, breaches, watch_rate_limits
from ledger.tasks import watch_declared_rate_limits
from tests.conftest import Api, person, registered
from tests.ledger.conftest import killed_while_it_waits_on_a_row, superuser_sql

T0 = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)
TWO_A_MINUTE = RateLimit(count=2, window=dt.timedelta(minutes=1), declared={})
FLAG = "rate_limit_exceeded"


def at(*seconds: float) -> list[Admission]:
    return [
        Admission(T0 + dt.timedelta(seconds=s), f"inv-{n}", "a1") for n, s in enumerate(seconds)
    ]


def exceeded(found: list[rate_limits.Breach]) -> list[tuple[str, int]]:
    return [(breach.admission.invocation_id, breach.in_window) for breach in found]


@pytest.mark.parametrize(
    ("window", "length"),
    [
        ("30s", dt.timedelta(seconds=30)),
        ("1m", dt.timedelta(minutes=1)),
        ("12h", dt.timedelta(hours=12)),
        ("7d", dt.timedelta(days=7)),
    ],
)
def test_a_declared_window_is_read_in_its_unit(window: str, length: dt.timedelta) -> None:
    declared = {"execution": {"rate_limit": {"count": 3, "window": window}}}
    limit = RateLimit.declared_by(declared)
    assert limit is not None and (limit.count, limit.window) == (3, length)


@pytest.mark.parametrize(
    "declaration",
    [{}, {"execution": {"readonly": True}}, {"execution": {"rate_limit": {"window": "1m"}}}],
)
def test_no_limit_is_read_where_none_is_declared(declaration: dict[str, Any]) -> None:
    assert RateLimit.declared_by(declaration) is None


def test_the_admission_past_the_count_within_the_window_exceeds_it() -> None:
    found, _ = breaches([], at(0, 10, 20, 30), TWO_A_MINUTE)
    assert exceeded(found) == [("inv-2", 3), ("inv-3", 4)]


def test_the_window_slides_rather_than_resetting_on_the_minute() -> None:
    """Three in 15 s across the turn of a minute: fixed windows would count two and one."""
    found, _ = breaches([], at(50, 59, 65), TWO_A_MINUTE)
    assert exceeded(found) == [("inv-2", 3)]


def test_admissions_a_whole_window_apart_do_not_count_together() -> None:
    found, _ = breaches([], at(0, 30, 60, 90, 120), TWO_A_MINUTE)
    assert found == []  # (t - 1 min, t] holds two at most: 60 s ago is outside


def test_admissions_given_out_of_order_are_judged_in_time_order() -> None:
    found, _ = breaches([], list(reversed(at(0, 10, 20))), TWO_A_MINUTE)
    assert exceeded(found) == [("inv-2", 3)]


def test_what_is_remembered_judges_the_next_admissions_and_no_more_is_kept() -> None:
    first, remembered = breaches([], at(0, 5, 10, 15), TWO_A_MINUTE)
    assert exceeded(first) == [("inv-2", 3), ("inv-3", 4)]
    assert remembered == [T0 + dt.timedelta(seconds=s) for s in (10, 15)]
    second, remembered = breaches(remembered, at(20), TWO_A_MINUTE)
    assert exceeded(second) == [("inv-0", 3)]
    _, remembered = breaches(remembered, at(200), TWO_A_MINUTE)
    assert remembered == [T0 + dt.timedelta(seconds=200)]  # the rest is a window behind


# Against the database: the watch reads what the sealer numbered.


@pytest.fixture
def limited(db: None) -> Capability:
    return registered("refund.create", rate_limit={"count": 2, "window": "1h"})


def admit(api: Api, *numbers: int, scope: str = "refund.create") -> None:
    for n in numbers:
        status, body = api.intent(
            invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", capability=scope, attempt_id="a1"
        )
        assert status == 201, body


def flagged() -> list[str]:
    return sorted(
        Invocation.objects.filter(flags__contains=[FLAG]).values_list("invocation_id", flat=True)
    )


def test_an_admission_beyond_the_declared_rate_flags_its_invocation_once(
    api: Api, limited: Capability
) -> None:
    admit(api, 1, 2, 3)
    seal_events()
    watched = watch_rate_limits()
    assert (watched.admissions, watched.breaches, watched.flagged) == (3, 1, ["inv-3"])
    assert flagged() == ["inv-3"]
    event = Event.objects.get(kind="rate_limit_exceeded")
    assert event.actor == "ledger:rate_watch"
    assert event.data["rate_limit"] == {"count": 2, "window": "1h"}
    [attempt] = event.data["attempts"]
    assert (attempt["attempt_id"], attempt["admitted_in_window"]) == ("a1", 3)
    admitted = Event.objects.get(invocation__invocation_id="inv-3", kind="attempt_admitted")
    assert attempt["admitted_at"] == admitted.created_at.isoformat()
    # The runtime sees the flag; nothing else about the invocation changed.
    _, state = api.get("/api/v1/invocations/inv-3")
    assert (state["status"], state["flags"]) == ("in_flight", [FLAG])
    assert api.outcome("inv-3", "a1", kind="succeeded")[1]["status"] == "succeeded"
    # Read once: a second run finds nothing new, and the chain verifies.
    seal_events()
    assert watch_rate_limits().breaches == 0
    assert Event.objects.filter(kind="rate_limit_exceeded").count() == 1
    assert verify().ok


def test_admissions_are_judged_only_once_sealed(api: Api, limited: Capability) -> None:
    admit(api, 1, 2)
    seal_events()
    admit(api, 3)
    assert watch_rate_limits().flagged == []  # inv-3's admission is not sealed yet
    seal_events()
    assert watch_rate_limits().flagged == ["inv-3"]


def test_retries_and_every_runtime_count_against_the_capability(
    api: Api, api_b: Api, limited: Capability
) -> None:
    admit(api, 1)
    api.outcome("inv-1", "a1", kind="pre_dispatch_rejected")
    assert api.attempt("inv-1", "a2")[0] == 201
    admit(api_b, 2)
    seal_events()
    assert watch_rate_limits().flagged == ["inv-2"]  # runtime B's, the third admission


def test_other_capabilities_and_undeclared_ones_are_not_counted(
    api: Api, limited: Capability
) -> None:
    registered("order.read", readonly=True)
    admit(api, 1, 2, scope="order.read")
    admit(api, 3, 4, scope="undeclared.thing")
    admit(api, 5, 6)
    seal_events()
    watched = watch_rate_limits()
    assert (watched.admissions, watched.flagged) == (2, [])


def test_only_admissions_since_the_limit_was_declared_are_judged_or_counted(
    api: Api, db: None
) -> None:
    registered("refund.create")
    admit(api, 1, 2, 3)  # no limit declared yet, and not sealed before the watch starts
    registered("refund.create", rate_limit={"count": 2, "window": "1h"})
    admit(api, 4, 5)  # declared, and made before the watch's first run
    seal_events()
    watched = watch_rate_limits()
    assert (watched.admissions, watched.flagged) == (5, [])  # 4 and 5 alone count
    admit(api, 6)
    seal_events()
    assert watch_rate_limits().flagged == ["inv-6"]
    # The limit withdrawn, the watch is dropped.
    registered("refund.create")
    watch_rate_limits()
    assert not RateWatch.objects.exists()


def test_a_changed_limit_counts_afresh_from_its_declaration(api: Api, limited: Capability) -> None:
    admit(api, 1, 2)
    seal_events()
    assert watch_rate_limits().flagged == []
    registered("refund.create", rate_limit={"count": 3, "window": "1h"})
    admit(api, 3, 4, 5)
    seal_events()
    assert watch_rate_limits().flagged == []  # three since the change, of three
    admit(api, 6)
    seal_events()
    assert watch_rate_limits().flagged == ["inv-6"]
    assert RateWatch.objects.get().rate_limit == {"count": 3, "window": "1h"}


def test_a_run_that_reads_a_full_batch_leaves_the_rest_to_the_next(
    api: Api, limited: Capability
) -> None:
    admit(api, 1, 2, 3, 4)  # each an intent and an admission: sealed events 1 to 8
    seal_events()
    first = watch_rate_limits(batch=6)
    assert (first.admissions, first.flagged, first.caught_up) == (3, ["inv-3"], False)
    second = watch_rate_limits(batch=6)
    assert (second.admissions, second.flagged, second.caught_up) == (1, ["inv-4"], True)


@pytest.mark.django_db(transaction=True)
def test_a_watch_killed_halfway_records_nothing_and_the_next_run_reads_it_again(
    api: Api, limited: Capability
) -> None:
    """A watch in its own process, flagging one invocation per write, killed with
    SIGKILL while its second flag waits on a row lock: its cursor and its flags are
    one transaction, so none is kept, and the next run records each breach once."""
    watch_rate_limits()  # the watch's row, whose cursor the killed run must not move
    admit(api, 1, 2, 3, 4)
    seal_events()
    before = RateWatch.objects.get().through_sequence
    killed_while_it_waits_on_a_row("inv-4", RUN_THE_WATCH)
    assert RateWatch.objects.get().through_sequence == before
    assert flagged() == []
    # The next run waits for the dead one's session to end, then reads it all again.
    assert watch_rate_limits().flagged == ["inv-3", "inv-4"]
    assert Event.objects.filter(kind=FLAG).count() == 2


RUN_THE_WATCH = (
    "import django; django.setup(); "
    "from ledger import rate_limits, watches; watches.FLAGS_PER_WRITE = 1; "
    "rate_limits.watch_rate_limits()"
)


def test_a_breach_on_a_row_changed_outside_the_ledger_waits_until_it_is_restored(
    api: Api, limited: Capability, caplog: pytest.LogCaptureFixture
) -> None:
    admit(api, 1, 2, 3, 4)
    seal_events()
    superuser_sql(
        "UPDATE ledger_invocation SET flags = '{undeclared}' WHERE invocation_id = 'inv-3'"
    )
    with caplog.at_level(logging.ERROR, logger="ledger.rate_limits"):
        watched = watch_rate_limits()
    assert (watched.flagged, watched.unrecorded) == (["inv-4"], 1)
    assert "rate watch could not flag invocation=inv-3 error=projection_broken" in caplog.text
    assert RateWatch.objects.get().unrecorded[0]["invocation_id"] == "inv-3"
    page = person("cora", "compliance").get("/audit/capabilities/refund.create/")
    assert "1 breach waiting to be recorded, on rows changed outside the ledger" in (
        page.content.decode()
    )
    # Still refused: it waits, and the watch does not log it again.
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="ledger.rate_limits"):
        assert watch_rate_limits().unrecorded == 1
    assert "rate watch" not in caplog.text
    restore_projection(invocation_id="inv-3", actor="user:ada", reason="rate watch test")
    watched = watch_rate_limits()
    assert (watched.flagged, watched.unrecorded) == (["inv-3"], 0)
    assert (
        Event.objects.get(invocation__invocation_id="inv-3", kind=FLAG).data["attempts"][0][
            "admitted_in_window"
        ]
        == 3
    )
    assert flagged() == ["inv-3", "inv-4"]


def test_compliance_finds_the_flagged_invocations_and_the_capability_page_says_how(
    api: Api, limited: Capability
) -> None:
    admit(api, 1, 2, 3)
    seal_events()
    watch_rate_limits()
    reviewer = person("cora", "compliance")
    found = reviewer.get("/audit/", {"flag": FLAG}).content.decode()
    assert "inv-3" in found and "inv-2" not in found
    page = reviewer.get("/audit/capabilities/refund.create/").content.decode()
    assert "<dt>rate limit</dt><dd>2 per 1h, as declared:" in page
    assert f'href="/audit/?capability=refund.create&amp;flag={FLAG}"' in page
    assert "; sealed events read through #" in page
    invocation = reviewer.get("/invocations/inv-3/").content.decode()
    assert (
        f'<dt>flags</dt><dd><a href="/audit/?flag={FLAG}">{FLAG}</a>: an attempt was admitted '
        "beyond its capability&#x27;s declared execution.rate_limit</dd>"
    ) in invocation


def test_a_breach_waiting_when_the_limit_is_withdrawn_is_still_recorded(
    api: Api, limited: Capability
) -> None:
    admit(api, 1, 2, 3)
    seal_events()
    superuser_sql(
        "UPDATE ledger_invocation SET flags = '{undeclared}' WHERE invocation_id = 'inv-3'"
    )
    assert watch_rate_limits().unrecorded == 1
    registered("refund.create")  # the limit withdrawn
    admit(api, 4, 5, 6)
    seal_events()
    watched = watch_rate_limits()
    assert (watched.admissions, watched.unrecorded) == (0, 1)
    restore_projection(invocation_id="inv-3", actor="user:ada", reason="rate watch test")
    assert watch_rate_limits().flagged == ["inv-3"]
    assert not RateWatch.objects.exists()
    # Declared again, the watch counts from the new declaration: not inv-4 to inv-6.
    registered("refund.create", rate_limit={"count": 2, "window": "1h"})
    admit(api, 7, 8, 9)
    seal_events()
    assert watch_rate_limits().flagged == ["inv-9"]


def test_beats_watch_task_reads_until_it_has_caught_up(
    api: Api, limited: Capability, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rate_limits, "BATCH", 2)
    admit(api, 1, 2, 3, 4, 5)
    seal_events()
    # Ten sealed events, two a run: inv-3, inv-4 and inv-5 flagged in one call.
    assert watch_declared_rate_limits.run() == 3
    assert flagged() == ["inv-3", "inv-4", "inv-5"]


def test_beats_watch_task_reads_for_its_time_and_the_next_run_goes_on(
    api: Api, limited: Capability, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    """Past LEDGER_CATCH_UP_SECONDS (here at once) a run ends after the batch it read;
    the next run reads on from there."""
    monkeypatch.setattr(rate_limits, "BATCH", 2)
    admit(api, 1, 2, 3, 4, 5)
    seal_events()
    settings.LEDGER_CATCH_UP_SECONDS = 0
    # An admission's two events a run: inv-1 and inv-2 within the limit, then each
    # one beyond it, then nothing left to read.
    assert [watch_declared_rate_limits.run() for _ in range(6)] == [0, 0, 1, 1, 1, 0]
    assert flagged() == ["inv-3", "inv-4", "inv-5"]
