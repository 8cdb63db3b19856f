"""A small sealed ledger, and tampering with it as a superuser would."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from ledger.integrity import seal_events
from ledger.models import Capability
from tests.conftest import ROOT, Api, process_env, wait_for


@pytest.fixture
def ledger(api: Api, refund: Capability) -> Api:
    """Three invocations with events, sealed once, then one more event unsealed."""
    for n in (1, 2, 3):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        api.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference=f"RF-{n}")
    assert seal_events() is not None
    api.intent(invocation_id="inv-4", idempotency_key="k-4")
    return api


def superuser_sql(sql: str, *params: str | int | dt.datetime | list[str]) -> None:
    """Tampering as a superuser, who can switch every trigger off for a session."""
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        try:
            cursor.execute(sql, params)
        finally:
            cursor.execute("SET session_replication_role = origin")


@contextmanager
def ledger_clock_at(at: dt.datetime) -> Iterator[None]:
    """The ledger's clock (django.utils.timezone.now, which the services read) at `at`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timezone, "now", lambda: at)
        yield


@contextmanager
def at_migration(name: str) -> Iterator[None]:
    """The database as ledger's migration `name` left it, for rows written as they were
    then; migrated forward to the latest after, whatever happens."""
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
    MigrationExecutor(connection).migrate([("ledger", name)])
    try:
        yield
    finally:
        MigrationExecutor(connection).migrate(latest)


def killed_while_it_waits_on_a_row(invocation_id: str, code: str) -> None:
    """Run `code` in its own process while another session holds the invocation's row,
    and kill it with SIGKILL once it waits on that row's lock."""
    from tests.ledger.test_faults import admin_conninfo

    with (
        psycopg.connect(admin_conninfo()) as holder,
        psycopg.connect(admin_conninfo(), autocommit=True) as onlooker,
    ):
        holder.execute(
            "SELECT 1 FROM ledger_invocation WHERE invocation_id = %s FOR UPDATE", [invocation_id]
        )
        process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=process_env())

        def waits_on_the_row() -> bool:
            assert process.poll() is None, "it ended before it reached the row"
            waiting = onlooker.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%%ledger_invocation%%'"
            ).fetchone()
            return waiting == (1,)

        wait_for(waits_on_the_row)
        process.kill()
        assert process.wait() == -signal.SIGKILL
        holder.rollback()
