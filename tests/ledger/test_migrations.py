"""The migrations build the schema the models describe, and build it on a live ledger
without locking out the runtimes' writes."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.contrib.postgres.operations import AddIndexConcurrently
from django.core.management import call_command
from django.db import connection, connections, migrations
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.loader import MigrationLoader
from django.utils import timezone

from ledger.db.operations import AddIndexToPartitionsConcurrently
from ledger.partitions import month_partition
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
    concurrently at once, AddIndexToPartitionsConcurrently builds one on each
    partition."""
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
                and not isinstance(op, AddIndexConcurrently | AddIndexToPartitionsConcurrently)
                and op.model_name_lower not in created
            ):
                blocking.append(f"{app}.{name}: {op.describe()}")
    assert blocking == []


def sessions_waiting(onlooker: psycopg.Connection[Any], statement: str) -> int:
    """How many sessions running a statement that starts so wait on a lock."""
    row = onlooker.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE %s",
        [statement.replace("%", "%%") + "%"],
    ).fetchone()
    assert row is not None
    return int(row[0])


class BackgroundMigration:
    """The migrations from `since` (its own, then the latest) in a thread of their own, on
    the test database rolled back to `since`; `finish` waits for them and says they all
    applied."""

    def __init__(self, since: str) -> None:
        self.latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
        MigrationExecutor(connection).migrate([("ledger", since)])
        self.failures: list[BaseException] = []
        self.thread = threading.Thread(target=self._migrate)

    def _migrate(self) -> None:
        try:
            MigrationExecutor(connections["default"]).migrate(self.latest)
        except BaseException as error:
            self.failures.append(error)
        finally:
            connections.close_all()

    def start(self) -> None:
        self.thread.start()

    def waits(self, onlooker: psycopg.Connection[Any], statement: str) -> Callable[[], bool]:
        def waiting() -> bool:
            assert self.thread.is_alive(), self.failures
            return sessions_waiting(onlooker, statement) > 0

        waiting.__doc__ = f"the migration's {statement!r} waits for a writer's transaction"
        return waiting

    def finish(self) -> None:
        if self.thread.ident is not None:  # started
            self.thread.join()
        MigrationExecutor(connection).migrate(self.latest)
        assert self.failures == []


class BackgroundIntents:
    """Intents sent from threads of their own, so that one held behind a lock holds up
    nothing but itself."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.threads: list[threading.Thread] = []

    def status_within(self, seconds: float, invocation_id: str) -> int | None:
        """The answer to an intent, or None if none came within `seconds`."""
        answers: list[int] = []

        def record() -> None:
            answers.append(
                self.api.intent(
                    invocation_id=invocation_id, idempotency_key=invocation_id, attempt_id="a1"
                )[0]
            )
            connections.close_all()

        thread = threading.Thread(target=record)
        self.threads.append(thread)
        thread.start()
        thread.join(seconds)
        return answers[0] if answers else None

    def join(self) -> None:
        for thread in self.threads:
            thread.join()


def index_validity(name: str) -> list[tuple[str, bool]]:
    """An index and the indexes attached to it on partitions, each with whether it is valid."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indexrelid::regclass::text, i.indisvalid FROM pg_index i "
            "WHERE i.indexrelid = %s::regclass OR i.indexrelid IN "
            "(SELECT inhrelid FROM pg_inherits WHERE inhparent = %s::regclass) ORDER BY 1",
            [name, name],
        )
        return cursor.fetchall()


@pytest.mark.django_db(transaction=True)
def test_intents_are_recorded_while_a_migration_builds_an_invocation_index(api: Api) -> None:
    """While a writer's transaction is open, the index build waits for it; an intent
    sent meanwhile is recorded, where behind a plain CREATE INDEX it would queue until
    the build ended."""
    migration = BackgroundMigration(since="0040_search_by_flag")
    intents = BackgroundIntents(api)
    with (
        psycopg.connect(admin_conninfo()) as writer,
        psycopg.connect(admin_conninfo(), autocommit=True) as onlooker,
    ):
        try:
            writer.execute("LOCK TABLE ledger_invocation IN ROW EXCLUSIVE MODE")
            migration.start()
            wait_for(migration.waits(onlooker, "CREATE INDEX"))
            recorded_while_building = intents.status_within(10, "inv-1")
        finally:
            writer.commit()
            migration.finish()
            intents.join()

    assert recorded_while_building == 201
    assert index_validity("invocation_cause_time") == [("invocation_cause_time", True)]


@pytest.mark.django_db(transaction=True)
def test_intents_are_recorded_while_a_migration_builds_an_event_index_on_each_partition(
    api: Api,
) -> None:
    """An index on the partitioned event table is made on the table alone, asking for
    its lock in short waits, then built concurrently on each partition. A writer's
    transaction open on the table holds up neither the intents sent meanwhile nor, once
    it ends, the build; one open on a partition only that partition's build. Behind a
    plain CREATE INDEX, each intent would wait until the build ended."""
    migration = BackgroundMigration(since="0043_verification_pass_invocations_to_check")
    intents = BackgroundIntents(api)
    with (
        psycopg.connect(admin_conninfo()) as table_writer,
        psycopg.connect(admin_conninfo()) as partition_writer,
        psycopg.connect(admin_conninfo(), autocommit=True) as onlooker,
    ):
        try:
            table_writer.execute("LOCK TABLE ONLY ledger_event IN ROW EXCLUSIVE MODE")
            this_month = month_partition(timezone.now())
            partition_writer.execute(f"LOCK TABLE {this_month} IN ROW EXCLUSIVE MODE")
            migration.start()
            wait_for(migration.waits(onlooker, "CREATE INDEX"))  # ON ONLY the table
            while_the_table_waits = intents.status_within(10, "inv-1")
            table_writer.commit()
            wait_for(migration.waits(onlooker, "CREATE INDEX CONCURRENTLY"))
            while_the_partition_waits = intents.status_within(10, "inv-2")
        finally:
            table_writer.commit()
            partition_writer.commit()
            migration.finish()
            intents.join()

    assert (while_the_table_waits, while_the_partition_waits) == (201, 201)
    partitions = event_partitions()
    assert len(partitions) > 1 and this_month in partitions
    assert index_validity("event_claim_reopened_time") == sorted(
        [("event_claim_reopened_time", True)]
        + [(f"{partition}_event_claim_reopened_time", True) for partition in partitions]
    )


def event_partitions() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT inhrelid::regclass::text FROM pg_inherits "
            "WHERE inhparent = 'ledger_event'::regclass ORDER BY 1"
        )
        return [name for (name,) in cursor.fetchall()]


@pytest.mark.django_db(transaction=True)
def test_an_event_index_build_that_stopped_midway_is_finished_by_migrating_again() -> None:
    """Where an earlier run stopped (killed, or a partition's build cancelled), one
    partition's index is attached, one is built but not attached, and one is invalid:
    migrating again attaches, drops and builds what each needs."""
    attached, unattached, invalid, *untouched = event_partitions()
    migration = BackgroundMigration(since="0043_verification_pass_invocations_to_check")
    condition = "WHERE kind IN ('lease_expired', 'probe_worker_lost')"
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE INDEX event_claim_reopened_time ON ONLY ledger_event (created_at) {condition}"
        )
        for partition in (attached, unattached, invalid):
            cursor.execute(
                f"CREATE INDEX {partition}_event_claim_reopened_time "
                f"ON {partition} (created_at) {condition}"
            )
        cursor.execute(
            "ALTER INDEX event_claim_reopened_time "
            f"ATTACH PARTITION {attached}_event_claim_reopened_time"
        )
        cursor.execute(
            "UPDATE pg_index SET indisvalid = false "
            f"WHERE indexrelid = '{invalid}_event_claim_reopened_time'::regclass"
        )
    assert index_validity("event_claim_reopened_time") == [
        ("event_claim_reopened_time", False),
        (f"{attached}_event_claim_reopened_time", True),
    ]

    migration.start()
    migration.finish()

    partitions = [attached, unattached, invalid, *untouched]
    assert index_validity("event_claim_reopened_time") == sorted(
        [("event_claim_reopened_time", True)]
        + [(f"{partition}_event_claim_reopened_time", True) for partition in partitions]
    )
