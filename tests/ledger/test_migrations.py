"""The migrations build the schema the models describe, and build it on a live ledger
without locking out the runtimes' writes."""

from __future__ import annotations

import io
import threading
from typing import Any

import psycopg
import pytest
from django.contrib.postgres.operations import AddIndexConcurrently
from django.core.management import call_command
from django.db import connection, connections, migrations
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader

from tests.conftest import Api, wait_for
from tests.ledger.test_faults import admin_conninfo


@pytest.mark.django_db
def test_every_model_change_has_its_migration() -> None:
    """A model's index or constraint changed without a migration would exist in no
    database, and the tests, which build theirs from the migrations, would not notice."""
    out = io.StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out)
    except SystemExit:  # what --check does when a migration is missing
        pytest.fail(f"the models changed with no migration:\n{out.getvalue()}")


# Written before the rule, and applied already wherever the ledger ran then.
BLOCKING_BEFORE_THE_RULE = {("ledger", f"{n:04}") for n in range(1, 39)}


def test_an_index_on_a_table_that_holds_rows_is_built_concurrently() -> None:
    """A plain CREATE INDEX holds off every INSERT and UPDATE of its table until it is
    built: on a ledger of millions of invocations, intents refused for as long. An
    index for a model the same migration creates has no rows to wait for.

    For the partitioned event table, whose indexes PostgreSQL cannot build
    concurrently at once: CREATE INDEX ON ONLY the table, then CREATE INDEX
    CONCURRENTLY on each partition and ALTER INDEX ... ATTACH PARTITION each."""
    blocking = []
    for (app, name), migration in MigrationLoader(None).disk_migrations.items():
        if app not in ("ledger", "reconciliation") or (app, name[:4]) in BLOCKING_BEFORE_THE_RULE:
            continue
        created = {
            op.name_lower for op in migration.operations if isinstance(op, migrations.CreateModel)
        }
        for op in migration.operations:
            if (
                isinstance(op, migrations.AddIndex)
                and not isinstance(op, AddIndexConcurrently)
                and op.model_name_lower not in created
            ):
                blocking.append(f"{app}.{name}: {op.describe()}")
    assert blocking == []


def writer_waiting_for(holder: psycopg.Connection[Any]) -> int:
    """How many sessions wait on a lock while `holder` keeps its transaction open."""
    row = holder.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query ILIKE 'CREATE INDEX%%'"
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.django_db(transaction=True)
def test_intents_are_recorded_while_a_migration_builds_an_invocation_index(api: Api) -> None:
    """While a writer's transaction is open, the index build waits for it; an intent
    sent meanwhile is recorded, where behind a plain CREATE INDEX it would queue until
    the build ended."""
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
    MigrationExecutor(connection).migrate([("ledger", "0040_search_by_flag")])
    failures: list[BaseException] = []

    def migrate() -> None:
        try:
            MigrationExecutor(connections["default"]).migrate(latest)
        except BaseException as error:
            failures.append(error)
        finally:
            connections.close_all()

    recorded: list[int] = []

    def record_intent() -> None:
        recorded.append(api.intent(attempt_id="a1")[0])
        connections.close_all()

    migrating = threading.Thread(target=migrate)
    writing = threading.Thread(target=record_intent)
    with (
        psycopg.connect(admin_conninfo()) as holder,
        psycopg.connect(admin_conninfo(), autocommit=True) as onlooker,
    ):
        try:
            holder.execute("LOCK TABLE ledger_invocation IN ROW EXCLUSIVE MODE")  # a writer
            migrating.start()

            def the_build_waits() -> bool:
                """the index build waits for the writer's transaction"""
                assert migrating.is_alive(), failures
                return writer_waiting_for(onlooker) > 0

            wait_for(the_build_waits)
            writing.start()
            writing.join(10)
            recorded_while_building = list(recorded)
        finally:
            holder.commit()
            migrating.join()
            writing.join()
            MigrationExecutor(connection).migrate(latest)

    assert failures == []
    assert recorded_while_building == [201]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'invocation_cause_time'::regclass"
        )
        assert cursor.fetchone() == (True,)
