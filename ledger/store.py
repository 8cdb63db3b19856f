"""The SQL behind a unit of evidence work: one statement to read, one to write.

The ORM would spend about a millisecond of Python per query on these machines,
more than PostgreSQL spends on the whole write, so the evidence hot path speaks SQL
directly (the rest of the project uses the ORM):

- `load` reads the capabilities and the invocations a request names, with their
  attempts and outcomes, as one JSON row;
- `write` inserts every new row and updates every touched projection in one
  statement. Each projection update is a compare-and-set on `event_count`; a new
  invocation is `ON CONFLICT DO NOTHING`. If any of them did not happen, another
  request won a race, and `ledger_assert_written` raises so that the whole
  statement rolls back and the caller reloads and applies its items again.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connection, models, transaction
from psycopg.types.json import Jsonb

from ledger.models import Attempt, Capability, Event, Invocation, Outcome

RACE_LOST_SQLSTATE = "LD001"

LOAD_SQL = """
SELECT
  (SELECT coalesce(json_agg(c), '[]') FROM ledger_capability c WHERE c.scope = ANY(%(scopes)s)),
  (SELECT coalesce(json_agg(json_build_object(
      'invocation', i,
      'capability', (SELECT row_to_json(c) FROM ledger_capability c WHERE c.id = i.capability_id),
      'attempts', (SELECT coalesce(json_agg(json_build_object('attempt', a, 'outcome', o)), '[]')
                   FROM ledger_attempt a LEFT JOIN ledger_outcome o ON o.attempt_id = a.id
                   WHERE a.invocation_id = i.id))), '[]')
   FROM ledger_invocation i
   WHERE i.invocation_id = ANY(%(ids)s)
      OR (i.capability_scope = ANY(%(scopes)s) AND i.idempotency_key = ANY(%(keys)s)))
"""

SQL_TYPES = {
    "CharField": "text",
    "TextField": "text",
    "BooleanField": "boolean",
    "PositiveSmallIntegerField": "integer",
    "PositiveIntegerField": "integer",
    "BigAutoField": "bigint",
    "ForeignKey": "bigint",
    "OneToOneField": "bigint",
    "DateTimeField": "timestamptz",
    "JSONField": "jsonb",
    # Arrays travel as JSON: a text[][] parameter would have to be rectangular.
    "ArrayField": "jsonb",
}


def _spec(model: type[models.Model], names: Iterable[str]) -> list[tuple[str, str]]:
    by_column = {f.column: f for f in model._meta.concrete_fields}
    return [(name, SQL_TYPES[by_column[name].get_internal_type()]) for name in names]


def _unnest(spec: Sequence[tuple[str, str]], alias: str) -> str:
    """`unnest(%s::t[], …) AS alias(name, …)`: one array parameter per column."""
    arrays = ", ".join(f"%s::{sql_type}[]" for _, sql_type in spec)
    return f"unnest({arrays}) AS {alias}({', '.join(name for name, _ in spec)})"


def _read(model: type[models.Model], name: str, alias: str) -> str:
    field_ = next(f for f in model._meta.concrete_fields if f.column == name)
    if field_.get_internal_type() == "ArrayField":
        return f"ARRAY(SELECT jsonb_array_elements_text({alias}.{name}))"
    return f"{alias}.{name}"


def _reads(model: type[models.Model], names: Iterable[str], alias: str) -> str:
    return ", ".join(_read(model, name, alias) for name in names)


def _stored_columns(model: type[models.Model], *, skip: Iterable[str] = ()) -> list[str]:
    return [
        str(f.column)
        for f in model._meta.concrete_fields
        if not f.primary_key and f.name not in skip
    ]


INVOCATION_COLUMNS = _stored_columns(Invocation)
PROJECTION_COLUMNS = [
    "status", "failure_class", "cause", "resolution", "flags", "attempt_count",
    "in_flight_attempt", "deadline_at", "event_count", "head_hash", "updated_at",
    "lease_owner", "lease_expires_at", "probe_tries", "next_probe_at", "proposal", "assignee",
]  # fmt: skip
ATTEMPT_COLUMNS = ["attempt_id", "number", "admitted_at", "deadline_at"]
OUTCOME_COLUMNS = _stored_columns(Outcome, skip=["attempt"])
EVENT_COLUMNS = ["seq", "kind", "actor", "data", "created_at", "prev_hash", "hash"]

NEW_INVOCATION_SPEC = _spec(Invocation, INVOCATION_COLUMNS)
UPDATE_SPEC = [
    ("row_id", "bigint"),
    ("expected", "integer"),
    *_spec(Invocation, PROJECTION_COLUMNS),
]
ATTEMPT_SPEC = [("owner", "text"), *_spec(Attempt, ATTEMPT_COLUMNS)]
OUTCOME_SPEC = [
    ("owner", "text"),
    ("attempt_key", "text"),
    ("attempt_pk", "bigint"),
    *_spec(Outcome, OUTCOME_COLUMNS),
]
EVENT_SPEC = [("owner", "text"), *_spec(Event, EVENT_COLUMNS)]

NEW_INVOCATION_CTE = f"""
new_invocation AS (
  INSERT INTO ledger_invocation ({", ".join(INVOCATION_COLUMNS)})
  SELECT {_reads(Invocation, INVOCATION_COLUMNS, "v")}
  FROM {_unnest(NEW_INVOCATION_SPEC, "v")}
  ON CONFLICT DO NOTHING
  RETURNING id, invocation_id
)"""
UPDATED_CTE = f"""
updated AS (
  UPDATE ledger_invocation i
  SET {", ".join(f"{c} = {_read(Invocation, c, 'v')}" for c in PROJECTION_COLUMNS)}
  FROM {_unnest(UPDATE_SPEC, "v")}
  WHERE i.id = v.row_id AND i.event_count = v.expected
  RETURNING i.id, i.invocation_id
)"""
NEW_ATTEMPT_CTE = f"""
new_attempt AS (
  INSERT INTO ledger_attempt (invocation_id, {", ".join(ATTEMPT_COLUMNS)})
  SELECT t.id, {_reads(Attempt, ATTEMPT_COLUMNS, "v")}
  FROM {_unnest(ATTEMPT_SPEC, "v")}
  JOIN touched t ON t.invocation_id = v.owner
  RETURNING id, invocation_id, attempt_id
)"""
NEW_OUTCOME_CTE = """
new_outcome AS (
  INSERT INTO ledger_outcome (attempt_id, {columns})
  SELECT {attempt}, {reads}
  FROM {unnest}
  JOIN touched t ON t.invocation_id = v.owner
  {join}
  RETURNING 1
)"""
NEW_EVENT_CTE = f"""
new_event AS (
  INSERT INTO ledger_event (invocation_id, {", ".join(EVENT_COLUMNS)})
  SELECT t.id, {_reads(Event, EVENT_COLUMNS, "v")}
  FROM {_unnest(EVENT_SPEC, "v")}
  JOIN touched t ON t.invocation_id = v.owner
  RETURNING 1
)"""


@functools.cache
def write_sql(new_invocations: bool, updates: bool, new_attempts: bool, new_outcomes: bool) -> str:
    """The write statement for one shape of unit, with only the parts it needs.

    Each request shape (an intent, an intent with its first attempt, an attempt, an
    outcome, a batch) gets its own text, so psycopg prepares each once per
    connection and PostgreSQL plans it once.
    """
    parts, counted = [], []
    touched = []
    if new_invocations:
        parts.append(NEW_INVOCATION_CTE)
        counted.append("new_invocation")
        touched.append("SELECT id, invocation_id FROM new_invocation")
    if updates:
        parts.append(UPDATED_CTE)
        counted.append("updated")
        touched.append("SELECT id, invocation_id FROM updated")
    parts.append(f"\ntouched AS ({' UNION ALL '.join(touched)})")
    if new_attempts:
        parts.append(NEW_ATTEMPT_CTE)
        counted.append("new_attempt")
    if new_outcomes:
        parts.append(
            NEW_OUTCOME_CTE.format(
                columns=", ".join(OUTCOME_COLUMNS),
                reads=_reads(Outcome, OUTCOME_COLUMNS, "v"),
                unnest=_unnest(OUTCOME_SPEC, "v"),
                attempt="coalesce(v.attempt_pk, na.id)" if new_attempts else "v.attempt_pk",
                join="LEFT JOIN new_attempt na ON na.invocation_id = t.id "
                "AND na.attempt_id = v.attempt_key"
                if new_attempts
                else "",
            )
        )
        counted.append("new_outcome")
    parts.append(NEW_EVENT_CTE)
    counted.append("new_event")
    checks = " AND ".join(f"(SELECT count(*) FROM {name}) = %s" for name in counted)
    return f"WITH {','.join(parts)}\nSELECT ledger_assert_written({checks})"


class RaceLost(Exception):
    """Another request changed an invocation this unit read; reload and retry."""


def _value(field_: models.Field, raw: Any) -> Any:
    if raw is None:
        return None
    if isinstance(field_, models.DateTimeField):
        return dt.datetime.fromisoformat(raw)
    return raw


def _instance[M: models.Model](model: type[M], row: dict[str, Any]) -> M:
    fields = model._meta.concrete_fields
    return model.from_db(
        "default", [f.attname for f in fields], [_value(f, row.get(str(f.column))) for f in fields]
    )


@dataclass
class Loaded:
    capabilities: list[Capability] = field(default_factory=list)
    invocations: list[tuple[Invocation, list[tuple[Attempt, Outcome | None]]]] = field(
        default_factory=list
    )


def load(*, ids: Iterable[str], scopes: Iterable[str], keys: Iterable[str]) -> Loaded:
    with connection.cursor() as cursor:
        cursor.execute(LOAD_SQL, {"ids": list(ids), "scopes": list(scopes), "keys": list(keys)})
        capabilities_json, invocations_json = cursor.fetchone()
    loaded = Loaded(capabilities=[_instance(Capability, row) for row in _json(capabilities_json)])
    for entry in _json(invocations_json):
        attempts = [
            (
                _instance(Attempt, pair["attempt"]),
                _instance(Outcome, pair["outcome"]) if pair["outcome"] else None,
            )
            for pair in entry["attempts"]
        ]
        invocation = _instance(Invocation, entry["invocation"])
        if entry["capability"]:
            invocation.capability = _instance(Capability, entry["capability"])
        loaded.invocations.append((invocation, attempts))
    return loaded


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def _param(sql_type: str, value: Any) -> Any:
    if sql_type == "jsonb" and value is not None:
        return Jsonb(value)
    return value


def _arrays(spec: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Column-major parameters for `_unnest(spec)` from row-major values."""
    return [[_param(sql_type, row[i]) for row in rows] for i, (_, sql_type) in enumerate(spec)]


def _attrs(model: type[models.Model], obj: models.Model, names: Iterable[str]) -> list[Any]:
    by_column = {f.column: f.attname for f in model._meta.concrete_fields}
    return [getattr(obj, by_column[name]) for name in names]


@dataclass
class Writes:
    new_invocations: list[Invocation]
    updated: list[tuple[Invocation, int]]  # with the event_count that was read
    new_attempts: list[Attempt]
    new_outcomes: list[tuple[Outcome, str, str, int | None]]  # owner, attempt_id, attempt pk
    new_events: list[tuple[Event, str]]  # owner invocation_id


def write(writes: Writes) -> None:
    """Write everything or nothing; RaceLost when a concurrent request got there first."""
    shape = (
        bool(writes.new_invocations),
        bool(writes.updated),
        bool(writes.new_attempts),
        bool(writes.new_outcomes),
    )
    params: list[Any] = []
    counts: list[int] = []
    if writes.new_invocations:
        rows = [_attrs(Invocation, row, INVOCATION_COLUMNS) for row in writes.new_invocations]
        params += _arrays(NEW_INVOCATION_SPEC, rows)
        counts.append(len(rows))
    if writes.updated:
        rows = [
            [row.pk, expected, *_attrs(Invocation, row, PROJECTION_COLUMNS)]
            for row, expected in writes.updated
        ]
        params += _arrays(UPDATE_SPEC, rows)
        counts.append(len(rows))
    if writes.new_attempts:
        rows = [
            [a.invocation.invocation_id, *_attrs(Attempt, a, ATTEMPT_COLUMNS)]
            for a in writes.new_attempts
        ]
        params += _arrays(ATTEMPT_SPEC, rows)
        counts.append(len(rows))
    if writes.new_outcomes:
        rows = [
            [owner, attempt_id, attempt_pk, *_attrs(Outcome, o, OUTCOME_COLUMNS)]
            for o, owner, attempt_id, attempt_pk in writes.new_outcomes
        ]
        params += _arrays(OUTCOME_SPEC, rows)
        counts.append(len(rows))
    rows = [[owner, *_attrs(Event, e, EVENT_COLUMNS)] for e, owner in writes.new_events]
    params += _arrays(EVENT_SPEC, rows)
    counts.append(len(rows))
    # Inside a caller's transaction a savepoint contains the failure; on its own the
    # statement is its own transaction (no BEGIN/COMMIT round trips).
    scope = transaction.atomic() if connection.in_atomic_block else nullcontext()
    try:
        with scope, connection.cursor() as cursor:
            cursor.execute(write_sql(*shape), [*params, *counts])
    except DatabaseError as error:
        if getattr(error.__cause__, "sqlstate", None) == RACE_LOST_SQLSTATE:
            raise RaceLost from error
        raise
