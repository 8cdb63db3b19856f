"""How long a flagged invocation has waited: from when it came to need reconciliation,
whatever people and probes did to it meanwhile (`Invocation.flagged_at`)."""

from __future__ import annotations

import datetime as dt
import importlib

import pytest
from django.contrib.auth.models import Group, User
from django.db import IntegrityError, connection, transaction
from django.test import Client

from ledger import policy
from ledger.models import Capability, Invocation
from ledger.services import flag_missing_evidence
from reconciliation import probes, services
from tests.conftest import Api

backfill = importlib.import_module("ledger.migrations.0021_flagged_at")


def flagged_at_deadline(api: Api, invocation_id: str) -> dt.datetime:
    api.intent(invocation_id=invocation_id, idempotency_key=f"k-{invocation_id}", attempt_id="a1")
    deadline = Invocation.objects.get(invocation_id=invocation_id).deadline_at
    assert deadline is not None and flag_missing_evidence(invocation_id=invocation_id, now=deadline)
    return deadline


def waited_since(invocation_id: str) -> dt.datetime | None:
    return Invocation.objects.get(invocation_id=invocation_id).flagged_at


def test_claims_probes_and_escalation_keep_the_wait(api: Api, refund: Capability) -> None:
    flagged = flagged_at_deadline(api, "inv-1")
    later = flagged + dt.timedelta(minutes=30)
    services.invocation_assign(invocation_id="inv-1", actor="user:olga", take=True)
    assert services.invocation_claim(invocation_id="inv-1", worker="w", now=later)
    inconclusive = probes.ProbeResult(probes.Finding.INCONCLUSIVE)
    services.record_probe_result(invocation_id="inv-1", worker="w", result=inconclusive, now=later)
    invocation = Invocation.objects.get()
    assert invocation.updated_at == later
    assert invocation.flagged_at == flagged


def test_settling_clears_the_wait_and_a_new_flag_starts_it_again(
    api: Api, refund: Capability
) -> None:
    first = flagged_at_deadline(api, "inv-1")
    services.invocation_resolve(
        invocation_id="inv-1", actor="user:olga", effect=policy.Effect.ABSENT, note="no refund"
    )
    # A high-risk resolution is a proposal: still waiting, for a second person.
    assert waited_since("inv-1") == first
    services.invocation_approve(invocation_id="inv-1", actor="user:amir", note="checked")
    assert Invocation.objects.get().status == "retry_allowed"
    assert waited_since("inv-1") is None
    api.attempt("inv-1", "a2")
    deadline = Invocation.objects.get().deadline_at
    assert deadline is not None and flag_missing_evidence(invocation_id="inv-1", now=deadline)
    assert waited_since("inv-1") == deadline


def test_the_migration_recovers_the_wait_from_the_events(api: Api, refund: Capability) -> None:
    """0021 fills flagged_at for invocations already waiting; it must agree with what
    the services record, for each path into and out of the queue."""
    flagged_at_deadline(api, "waiting")
    flagged_at_deadline(api, "touched")
    services.invocation_assign(invocation_id="touched", actor="user:olga", take=True)
    flagged_at_deadline(api, "flagged-twice")
    services.invocation_resolve(
        invocation_id="flagged-twice", actor="user:olga", effect=policy.Effect.ABSENT, note="n"
    )
    services.invocation_approve(invocation_id="flagged-twice", actor="user:amir", note="ok")
    api.attempt("flagged-twice", "a2")
    deadline = Invocation.objects.get(invocation_id="flagged-twice").deadline_at
    assert flag_missing_evidence(invocation_id="flagged-twice", now=deadline)
    api.intent(invocation_id="settled", idempotency_key="k-settled", attempt_id="a1")
    api.outcome("settled", "a1", kind="succeeded")

    recorded = dict(Invocation.objects.values_list("invocation_id", "flagged_at"))
    assert recorded["settled"] is None and all(
        recorded[i] for i in ("waiting", "touched", "flagged-twice")
    )
    with connection.cursor() as cursor:
        # As before 0021, when no flagged row had its time (0027's check came after).
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no checks pending, as ALTER asks
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conname = 'invocation_flagged_has_flagged_at'"
        )
        (check,) = cursor.fetchone()  # type: ignore[misc]
        cursor.execute(
            "ALTER TABLE ledger_invocation DROP CONSTRAINT invocation_flagged_has_flagged_at"
        )
        cursor.execute("UPDATE ledger_invocation SET flagged_at = NULL")
        cursor.execute(backfill.BACKFILL.format(flagged=backfill.FLAGGED))
        # The backfill leaves no flagged row untimed: the check holds again.
        name = "invocation_flagged_has_flagged_at"
        cursor.execute(f"ALTER TABLE ledger_invocation ADD CONSTRAINT {name} {check}")
    assert dict(Invocation.objects.values_list("invocation_id", "flagged_at")) == recorded


def test_the_queue_keeps_a_claimed_invocation_in_its_place(api: Api, refund: Capability) -> None:
    flagged_at_deadline(api, "first")
    flagged_at_deadline(api, "second")
    services.invocation_assign(invocation_id="first", actor="user:olga", take=True)
    olga = User.objects.create_user("olga")
    olga.groups.add(Group.objects.get_or_create(name="operator")[0])
    client = Client()
    client.force_login(olga)
    queue = client.get("/").content.decode()
    assert queue.index("/invocations/first/") < queue.index("/invocations/second/")
    page = client.get("/invocations/first/").content.decode()
    assert "waiting for" in page


def test_the_first_minute_of_a_wait_reads_under_a_minute() -> None:
    from django.utils import timezone

    from ledger.templatetags.console import waited

    now = timezone.now()
    assert waited(now - dt.timedelta(seconds=20)) == "under a minute"
    assert waited(now - dt.timedelta(minutes=5, seconds=10)) == "5\xa0minutes"
    assert waited(None) == ""


def test_the_queue_says_how_long_each_invocation_has_waited(api: Api, refund: Capability) -> None:
    now = dt.datetime.now(dt.UTC)
    for invocation_id, waited_for in (("fresh", dt.timedelta(seconds=20)),
                                      ("old", dt.timedelta(hours=2, minutes=3))):  # fmt: skip
        flagged_at_deadline(api, invocation_id)
        Invocation.objects.filter(invocation_id=invocation_id).update(flagged_at=now - waited_for)
    operator = User.objects.create_user("olga")
    operator.groups.add(Group.objects.get_or_create(name="operator")[0])
    client = Client()
    client.force_login(operator)

    rows = client.get("/").content.decode().split('<tr class="')[1:]

    waits = {row.split("/invocations/")[1].split("/")[0]: row for row in rows}
    assert "under a minute</time>" in waits["fresh"]
    assert "2\xa0hours, 3\xa0minutes</time>" in waits["old"]


@pytest.mark.parametrize("status", ["reconciliation_required", "escalated"])
def test_postgres_refuses_a_flagged_invocation_without_its_wait(
    api: Api, refund: Capability, status: str
) -> None:
    """The queue orders and pages by flagged_at, so no flagged row may lack it, even one
    written around the services."""
    api.intent(attempt_id="a1")
    with (
        pytest.raises(IntegrityError, match="invocation_flagged_has_flagged_at"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute(
            "UPDATE ledger_invocation SET status = %s, in_flight_attempt = '', "
            "deadline_at = NULL, flagged_at = NULL",
            [status],
        )
    assert Invocation.objects.get().status == "in_flight"
