"""Migration operations for a ledger that is running: indexes on the partitioned event
table built without holding off the runtimes' writes."""

from __future__ import annotations

from typing import Any, cast

import psycopg
from django.contrib.postgres.operations import NotInTransactionMixin
from django.db import OperationalError, transaction
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.backends.postgresql.schema import DatabaseSchemaEditor as PostgreSQLSchemaEditor
from django.db.backends.utils import truncate_name
from django.db.migrations import AddIndex
from django.db.migrations.state import ProjectState

# How long the table-wide step waits for its lock before it lets the writes queued
# behind it through and asks again, and how many times it asks.
LOCK_WAIT = "100ms"
LOCK_ASKS = 300

# Each partition of a table, with the index attached there to `%(index)s` if any.
PARTITIONS_SQL = """
SELECT c.relname,
       (SELECT i.indexrelid::regclass::text
          FROM pg_index i JOIN pg_inherits h ON h.inhrelid = i.indexrelid
         WHERE i.indrelid = c.oid AND h.inhparent = to_regclass(%(index)s))
  FROM pg_inherits p JOIN pg_class c ON c.oid = p.inhrelid
 WHERE p.inhparent = %(table)s::regclass
 ORDER BY c.relname
"""


class AddIndexToPartitionsConcurrently(NotInTransactionMixin, AddIndex):
    """Adds an index to a partitioned table the way AddIndexConcurrently does to a plain
    one: the table's inserts go on while it is built.

    PostgreSQL builds no index CONCURRENTLY on a partitioned table, and a plain CREATE
    INDEX holds off every insert into every partition until the last is built. So:

    1. CREATE INDEX ON ONLY the table makes its index, invalid and empty, at once. It
       needs the table's SHARE lock for an instant, but waiting for it would hold new
       inserts behind it for as long as the longest transaction in progress; so it asks
       with a short lock_timeout, again and again.
    2. Each partition that has no index attached to it yet gets one built CONCURRENTLY,
       then attached (ALTER INDEX ... ATTACH PARTITION, which no insert waits for).
       PostgreSQL makes the index on a partition attached meanwhile itself (beat makes
       them months ahead), and marks the table's index valid with the last one attached.

    A build that failed leaves an invalid index on its partition; running the migration
    again drops it and builds it again. Reversed, it drops the index at once (a plain
    DROP INDEX: PostgreSQL drops none of a partitioned table's concurrently).
    """

    atomic = False
    reduces_to_sql = False  # it reads the partitions from the catalog as it goes

    def describe(self) -> str:
        return (
            f"Create index {self.index.name} on each partition of model {self.model_name}, "
            "concurrently"
        )

    def database_forwards(
        self,
        app_label: str,
        schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState,
        to_state: ProjectState,
    ) -> None:
        self._ensure_not_in_transaction(schema_editor)
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        editor = cast(PostgreSQLSchemaEditor, schema_editor)  # for its SQL templates
        quote = schema_editor.quote_name
        table_index = quote(self.index.name)
        with schema_editor.connection.cursor() as cursor:
            if _index_validity(cursor, self.index.name) is None:
                only = editor.sql_create_index.replace(" ON %(table)s", " ON ONLY %(table)s")
                _execute_with_short_lock_waits(
                    schema_editor, str(self.index.create_sql(model, schema_editor, sql=only))
                )
            cursor.execute(
                PARTITIONS_SQL, {"index": self.index.name, "table": model._meta.db_table}
            )
            partitions = [name for name, attached in cursor.fetchall() if attached is None]
            for partition in partitions:
                name = truncate_name(f"{partition}_{self.index.name}", 63)
                valid = _index_validity(cursor, name)
                if valid is False:  # a build of an earlier run that failed
                    cursor.execute(f"DROP INDEX CONCURRENTLY {quote(name)}")
                if not valid:
                    on_partition = editor.sql_create_index_concurrently.replace(
                        "%(name)s ON %(table)s", f"{quote(name)} ON {quote(partition)}"
                    )
                    cursor.execute(
                        str(self.index.create_sql(model, schema_editor, sql=on_partition))
                    )
                cursor.execute(f"ALTER INDEX {table_index} ATTACH PARTITION {quote(name)}")

    def database_backwards(
        self,
        app_label: str,
        schema_editor: BaseDatabaseSchemaEditor,
        from_state: ProjectState,
        to_state: ProjectState,
    ) -> None:
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.remove_index(model, self.index)


def _index_validity(cursor: Any, name: str) -> bool | None:
    """Whether an index by that name is valid; None if there is none."""
    cursor.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [name])
    row = cursor.fetchone()
    return None if row is None else bool(row[0])


def _execute_with_short_lock_waits(schema_editor: BaseDatabaseSchemaEditor, sql: str) -> None:
    connection = schema_editor.connection
    for ask in range(1, LOCK_ASKS + 1):
        try:
            with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                cursor.execute("SELECT set_config('lock_timeout', %s, true)", [LOCK_WAIT])
                cursor.execute(sql)
            return
        except OperationalError as error:
            if not isinstance(error.__cause__, psycopg.errors.LockNotAvailable):
                raise
            if ask == LOCK_ASKS:
                raise OperationalError(
                    f"no moment free of other transactions in {LOCK_ASKS} tries of "
                    f"{LOCK_WAIT} each to lock the table for: {sql}"
                ) from error
