"""The SQL behind a unit of evidence work: one statement to read, one to write.

The ORM would spend about a millisecond of Python per query on these machines,
more than PostgreSQL spends on the whole write, so the evidence hot path speaks SQL
directly (the rest of the project uses the ORM):

- `active_token` finds the runtime token a request presents. A process that has
  read a token before skips that statement (ledger/api/authentication.py); the
  request's `load`, `write` or `detail` is then given the token's id
  (`confirm_token`) and checks, in the same statement, that it is still
  unrevoked, raising TokenRevoked (a write checks first and writes nothing);
- `load` reads the capabilities and the invocations a request names, with their
  attempts and outcomes, as one JSON row (`detail`, behind `GET` of one invocation,
  reads one invocation with its events the same way);
- `write` inserts every new row and updates every touched projection in one
  statement. Each projection update is a compare-and-set on `event_count`; a new
  invocation is `ON CONFLICT DO NOTHING`. If any of them did not happen, another
  request won a race, and `ledger_assert_written` raises so that the whole
  statement rolls back and the caller reloads and applies its items again. New
  intents under capabilities already read (`known_capabilities`), or under scopes
  read with none (undeclared), skip `load`; their write also checks that each
  capability row still reads as remembered, and that none was registered under
  such a scope since. A
  business reference that no one named when the unit read it is inserted into
  ledger_namedreference; if another unit named it meanwhile, that insert waits for
  it, inserts nothing and the race is lost the same way.

Rows travel as one JSON array per table, turned back into rows of the table's own
type by `jsonb_populate_record`, so the statement does not change with the number
of rows and PostgreSQL plans it once per connection. Both statements are written
with PostgreSQL's `$n` placeholders and run on a psycopg `RawCursor`: psycopg does
not cache its parsing of `%s` for statements this long, and that parsing cost more
than the statement itself.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import psycopg
from django.db import DatabaseError, connection, models, transaction

from ledger.models import Attempt, Capability, Event, Invocation, Outcome, Runtime, RuntimeToken

RACE_LOST_SQLSTATE = "LD001"
TOKEN_REVOKED_SQLSTATE = "LD002"  # noqa: S105 (an error code, not a secret)


def _token_active(placeholder: str) -> str:
    """True if the token is unrevoked; NULL if it was deleted, or if no id is given."""
    return (
        "(SELECT t.revoked_at IS NULL FROM ledger_runtimetoken t "
        f"WHERE t.id = {placeholder}::bigint)"
    )


# A capability row as it reads now: a unit that relied on a remembered capability
# checks, in its write, that the row still reads the same.
FINGERPRINT = "encode(sha256(convert_to(c::text, 'UTF8')), 'hex')"

# How many events naming a reference a load reads to tell who else names it.
NAMED_SAMPLE = 20

# Each outcome is read through the unique index on its attempt, as a subquery: as a
# LEFT JOIN, the prepared statement's plan could hash-join every outcome, and
# reading one invocation took twice as long (1.8 ms against 0.9 ms). The names come
# in through ledger_keys, which the planner counts as one row each (migration 0016),
# so that its generic plan looks each one up by index even on a table it has no
# statistics for.
LOAD_SQL = (
    """
SELECT
  (SELECT coalesce(json_agg(json_build_object('row', c, 'fingerprint', {fingerprint})), '[]')
   FROM ledger_keys($1::text[]) AS s(scope) JOIN ledger_capability c ON c.scope = s.scope),
  (SELECT coalesce(json_agg(json_build_object(
      'invocation', i,
      'capability', (SELECT row_to_json(c) FROM ledger_capability c WHERE c.id = i.capability_id),
      -- The event the row says is its last: what a write checks the row against.
      -- (In its invocation's month partition only; the rest are pruned as it runs.)
      'head', (SELECT json_build_object('state', e.data -> 'state', 'hash', e.hash)
               FROM ledger_event e WHERE e.invocation_id = i.id AND e.seq = i.event_count
                 AND e.invocation_created_at = i.created_at),
      -- And what its intent recorded of the columns fixed then, and by whom.
      'intent', (SELECT json_build_object('data', e.data, 'actor', e.actor)
                 FROM ledger_event e WHERE e.invocation_id = i.id AND e.seq = 1
                   AND e.invocation_created_at = i.created_at),
      'attempts', (SELECT coalesce(json_agg(json_build_object('attempt', a, 'outcome',
                     (SELECT row_to_json(o) FROM ledger_outcome o WHERE o.attempt_id = a.id))),
                     '[]')
                   FROM ledger_attempt a WHERE a.invocation_id = i.id))), '[]')
   FROM (SELECT DISTINCT ON (x.id) x.* FROM (
           SELECT x.* FROM ledger_keys($2::text[]) AS k(invocation_id)
           JOIN ledger_invocation x ON x.invocation_id = k.invocation_id
           UNION ALL
           -- OFFSET 0 keeps the pairs together, so that both halves reach the index.
           SELECT x.* FROM (SELECT * FROM ledger_keys($1::text[]) AS s(scope)
                            CROSS JOIN ledger_keys($3::text[]) AS k(idempotency_key)
                            OFFSET 0) AS p
           JOIN ledger_invocation x
             ON x.capability_scope = p.scope AND x.idempotency_key = p.idempotency_key) x
         ORDER BY x.id) i),
  {token_active},
  -- For each business reference an outcome names, the invocations whose evidence names
  -- it already, with their runtimes (through event_business_reference; a few events
  -- are enough to tell). Each invocation is looked up by its id: OFFSET 0 keeps the
  -- planner from joining them by hash, which a scan of every invocation would feed.
  (SELECT coalesce(json_object_agg(r.reference, (
      SELECT coalesce(jsonb_object_agg(i.invocation_id, i.runtime_id), '{}')
      FROM (SELECT e.invocation_id FROM ledger_event e
            WHERE (e.data -> 'business_reference') > '""'::jsonb
              AND (e.data -> 'business_reference') = to_jsonb(r.reference)
            LIMIT {named_limit}) n
      CROSS JOIN LATERAL (SELECT x.invocation_id, x.runtime_id FROM ledger_invocation x
                          WHERE x.id = n.invocation_id OFFSET 0) i)), '{}')
   FROM ledger_keys($5::text[]) AS r(reference))
""".replace("{fingerprint}", FINGERPRINT)
    .replace("{token_active}", _token_active("$4"))
    .replace("{named_limit}", str(NAMED_SAMPLE))
)


def _stored(model: type[models.Model], *, skip: Iterable[str] = ()) -> list[models.Field]:
    return [f for f in model._meta.concrete_fields if not f.primary_key and f.name not in skip]


# (column, attribute) pairs: rows are written by column, read from the model by attribute.
INVOCATION_FIELDS = [(str(f.column), f.attname) for f in _stored(Invocation)]
PROJECTION_FIELDS = [
    (name, name) for name in (
        "status", "failure_class", "cause", "resolution", "flags", "attempt_count",
        "in_flight_attempt", "deadline_at", "event_count", "head_hash", "updated_at",
        "flagged_at", "lease_owner", "lease_expires_at", "probe_tries", "next_probe_at", "proposal",
        "assignee",
    )
]  # fmt: skip
ATTEMPT_FIELDS = [(name, name) for name in ("attempt_id", "number", "admitted_at", "deadline_at")]
OUTCOME_FIELDS = [(str(f.column), f.attname) for f in _stored(Outcome, skip=["attempt"])]
EVENT_FIELDS = [
    (name, name) for name in ("seq", "kind", "actor", "data", "created_at", "prev_hash", "hash")
]


def _columns(fields: Sequence[tuple[str, str]], alias: str = "") -> str:
    return ", ".join(f"{alias}{column}" for column, _ in fields)


def _rows(table: str, placeholder: str, *, source: str = "jsonb_array_elements") -> str:
    """The rows of one JSON array parameter as `r.j` (the element) and `v` (the row)."""
    return (
        f"{source}({placeholder}::jsonb) AS r(j) "
        f"CROSS JOIN LATERAL jsonb_populate_record(NULL::{table}, r.j) AS v"
    )


@functools.cache
def write_sql(
    new_invocations: bool,
    updates: bool,
    new_attempts: bool,
    new_outcomes: bool,
    new_references: bool = False,
    checks_capabilities: bool = False,
    checks_token: bool = False,
) -> str:
    """The write statement for one shape of unit, with only the parts it needs.

    Each request shape (an intent, an intent with its first attempt, an attempt, an
    outcome, a batch) gets its own text, so psycopg prepares each once per
    connection and PostgreSQL plans it once. Parameter n of k is the JSON array of
    rows for the n-th part and parameter k + n their number; the check at the end
    counts that each part wrote all of them. (Counting with jsonb_array_length would
    parse each array a second time: a tenth of a 1,000-item batch's write.) With
    `checks_token`, parameter 2k + 1 is a runtime token's id, which must be unrevoked.
    """
    parts: list[str] = []
    written: list[tuple[str, str]] = []  # (CTE, its rows' placeholder)
    touched: list[str] = []

    def rows_of(cte: str) -> str:
        placeholder = f"${len(written) + 1}"
        written.append((cte, placeholder))
        return placeholder

    if new_invocations:
        parts.append(f"""
new_invocation AS (
  INSERT INTO ledger_invocation ({_columns(INVOCATION_FIELDS)})
  SELECT {_columns(INVOCATION_FIELDS, "v.")}
  FROM {_rows("ledger_invocation", rows_of("new_invocation"))}
  ON CONFLICT DO NOTHING
  RETURNING id, invocation_id, created_at
)""")
        touched.append("SELECT id, invocation_id, created_at FROM new_invocation")
    if updates:
        # ledger_rows, not jsonb_array_elements: counted as 100 rows, they made a
        # hash join over the whole invocation table the cheaper plan (migration 0016).
        assignments = ", ".join(f"{column} = v.{column}" for column, _ in PROJECTION_FIELDS)
        parts.append(f"""
updated AS (
  UPDATE ledger_invocation i SET {assignments}
  FROM {_rows("ledger_invocation", rows_of("updated"), source="ledger_rows")}
  WHERE i.id = v.id AND i.event_count = (r.j ->> 'expected')::integer
  RETURNING i.id, i.invocation_id, i.created_at
)""")
        touched.append("SELECT id, invocation_id, created_at FROM updated")
    parts.append(f"\ntouched AS ({' UNION ALL '.join(touched)})")
    if new_attempts:
        parts.append(f"""
new_attempt AS (
  INSERT INTO ledger_attempt (invocation_id, {_columns(ATTEMPT_FIELDS)})
  SELECT t.id, {_columns(ATTEMPT_FIELDS, "v.")}
  FROM {_rows("ledger_attempt", rows_of("new_attempt"))}
  JOIN touched t ON t.invocation_id = r.j ->> 'owner'
  RETURNING id, invocation_id, attempt_id
)""")
    if new_outcomes:
        # An outcome for an attempt admitted in this same unit finds it by attempt_id.
        attempt, join = "(r.j ->> 'attempt_pk')::bigint", ""
        if new_attempts:
            attempt = f"coalesce({attempt}, na.id)"
            join = (
                "LEFT JOIN new_attempt na ON na.invocation_id = t.id "
                "AND na.attempt_id = r.j ->> 'attempt_key'"
            )
        parts.append(f"""
new_outcome AS (
  INSERT INTO ledger_outcome (attempt_id, {_columns(OUTCOME_FIELDS)})
  SELECT {attempt}, {_columns(OUTCOME_FIELDS, "v.")}
  FROM {_rows("ledger_outcome", rows_of("new_outcome"))}
  JOIN touched t ON t.invocation_id = r.j ->> 'owner'
  {join}
  RETURNING 1
)""")
    parts.append(f"""
new_event AS (
  INSERT INTO ledger_event (invocation_id, invocation_created_at, {_columns(EVENT_FIELDS)})
  SELECT t.id, t.created_at, {_columns(EVENT_FIELDS, "v.")}
  FROM {_rows("ledger_event", rows_of("new_event"))}
  JOIN touched t ON t.invocation_id = r.j ->> 'owner'
  RETURNING 1
)""")
    if new_references:
        # The first to name a reference inserts it; a unit naming it at the same moment
        # waits here for that one to commit, then inserts nothing and so loses the race.
        parts.append(f"""
new_reference AS (
  INSERT INTO ledger_namedreference (reference, first_named_by_id)
  SELECT r.j ->> 'reference', t.id
  FROM jsonb_array_elements({rows_of("new_reference")}::jsonb) AS r(j)
  JOIN touched t ON t.invocation_id = r.j ->> 'owner'
  ON CONFLICT DO NOTHING
  RETURNING 1
)""")
    if checks_capabilities:
        parts.append(f"""
unchanged_capability AS (
  SELECT 1 FROM ledger_rows({rows_of("unchanged_capability")}::jsonb) AS r(j)
  LEFT JOIN ledger_capability c ON c.scope = r.j ->> 'scope'
  -- A scope remembered with no capability (no fingerprint) must still have none.
  WHERE CASE WHEN r.j ->> 'fingerprint' IS NULL THEN c.id IS NULL
             ELSE {FINGERPRINT} = r.j ->> 'fingerprint' END
)""")
    checks = " AND ".join(
        f"(SELECT count(*) FROM {cte}) = ${len(written) + n}::integer"
        for n, (cte, _) in enumerate(written, start=1)
    )
    assertion = f"ledger_assert_written({checks})"
    if checks_token:
        # CASE, unlike AND, fixes the order: a revoked token is answered as such even
        # when a race was lost too.
        token = _token_active(f"${2 * len(written) + 1}")
        assertion = (
            f"CASE WHEN ledger_assert_token_active(coalesce({token}, false)) THEN {assertion} END"
        )
    return f"WITH {','.join(parts)}\nSELECT {assertion}"


def _query(query: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
    """One statement on Django's connection, with `$n` placeholders: its first row.

    Django's execute wrappers still see it, as they would a query of the ORM.
    """
    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.RawCursor(connection.connection) as cursor:

        def run(sql: str, params: Sequence[Any], many: bool, context: dict[str, Any]) -> None:
            # Prepared once per connection (unless DATABASE_PREPARED_STATEMENTS is off).
            cursor.execute(sql, params, prepare=True)

        executor: Callable[..., None] = run
        for wrapper in reversed(connection.execute_wrappers):
            executor = functools.partial(wrapper, executor)
        executor(query, params, False, {"connection": connection, "cursor": cursor})
        return cursor.fetchone()


def _execute(query: str, params: Sequence[Any]) -> tuple[Any, ...]:
    """A statement that always answers one row (an aggregate)."""
    row = _query(query, params)
    assert row is not None
    return row


ACTIVE_CREDENTIAL_SQL = """
SELECT t.id, t.digest, r.id, r.name FROM ledger_runtimetoken t
JOIN ledger_runtime r ON r.id = t.runtime_id
WHERE t.prefix = $1 AND t.revoked_at IS NULL
"""


def active_token(prefix: str) -> RuntimeToken | None:
    """The unrevoked token with this prefix, with its runtime: every API request asks."""
    row = _query(ACTIVE_CREDENTIAL_SQL, [prefix])
    if row is None:
        return None
    token_id, digest, runtime_id, runtime_name = row
    return RuntimeToken(
        id=token_id, prefix=prefix, digest=digest, runtime=Runtime(id=runtime_id, name=runtime_name)
    )


_ENCODER = msgspec.json.Encoder()


class RaceLost(Exception):
    """Another request changed an invocation this unit read; reload and retry."""


# PostgreSQL broke a deadlock by aborting this statement: nothing it did remains.
DEADLOCK_SQLSTATE = "40P01"


class ProjectionBehind(Exception):
    """An event the write numbered from an invocation's `event_count` exists already:
    the row was changed outside the ledger (integrity.restore_projection mends it)."""


LOCK_SQL = """
SELECT count(*) FROM (
  SELECT id FROM ledger_invocation WHERE invocation_id = ANY($1::text[]) ORDER BY id FOR UPDATE
) AS locked
"""


def lock_invocations(ids: Iterable[str]) -> None:
    """Hold these invocations' rows until the caller's transaction ends.

    For a unit that keeps losing races: while it holds them, no other write can
    change them, so its own write cannot lose again. Rows are locked in id order, the
    same order for every caller, so that two lockers cannot deadlock each other.
    """
    assert connection.in_atomic_block, "a lock outside a transaction would end at once"
    try:
        _execute(LOCK_SQL, [sorted(ids)])
    except DatabaseError as error:
        if getattr(error.__cause__, "sqlstate", None) == DEADLOCK_SQLSTATE:
            raise RaceLost from error
        raise


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


@functools.cache
def _defaults(model: type[models.Model]) -> list[tuple[str, Callable[[], Any] | None, Any]]:
    """Each field's attname and default: a callable to call for each row, or the value
    Field.get_default() gives every time (it works that out again on each call)."""
    defaults: list[tuple[str, Callable[[], Any] | None, Any]] = []
    for f in model._meta.concrete_fields:
        if f.has_default() and callable(f.default):
            defaults.append((f.attname, f.default, None))
        else:
            defaults.append((f.attname, None, f.get_default()))
    return defaults


def new_instance[M: models.Model](model: type[M], **values: Any) -> M:
    """`model(**values)` through Django's positional fast path; keys are attnames.

    Given keywords, Model.__init__ looks up each field by name, then searches the
    leftovers for properties: 30 to 50 µs for an invocation's 40 fields, against
    about 10 µs positionally (a tenth of a batch item's Python). A field not given
    takes its default.
    """
    row = model(
        *[
            values.pop(name) if name in values else (make() if make else value)
            for name, make, value in _defaults(model)
        ]
    )
    if values:
        raise TypeError(f"{model.__name__} has no fields {sorted(values)}")
    return row


@dataclass(frozen=True, slots=True)
class KnownCapability:
    """A capability as read, or (both None) a scope read with none registered."""

    capability: Capability | None
    fingerprint: str | None


NOT_REGISTERED = KnownCapability(None, None)

# The capabilities this process has read, by scope. Any unit may rely on one only
# if its write checks the fingerprint (`Writes.unchanged_capabilities`). Only rows
# that exist are remembered here, so the memory is as large as the registry.
_known: dict[str, KnownCapability] = {}
# The scopes read with no capability (their intents are flagged undeclared), relied
# on the same way: the write checks that none was registered since. Runtimes name
# these, so only the most recently read are remembered.
_unregistered: OrderedDict[str, None] = OrderedDict()
UNREGISTERED_REMEMBERED = 1000


def known_capabilities(scopes: Iterable[str]) -> dict[str, KnownCapability] | None:
    """The remembered capabilities of these scopes, NOT_REGISTERED for a scope
    remembered with none, or None if one is not remembered."""
    known = {}
    for scope in scopes:
        if scope in _known:
            known[scope] = _known[scope]
        elif scope in _unregistered:
            known[scope] = NOT_REGISTERED
        else:
            return None
    return known


def _remember_unregistered(scope: str) -> None:
    _known.pop(scope, None)
    _unregistered[scope] = None
    _unregistered.move_to_end(scope)
    while len(_unregistered) > UNREGISTERED_REMEMBERED:
        _unregistered.popitem(last=False)


class Head(NamedTuple):
    """The event an invocation's row counts as its last: its recorded state and hash;
    and the data and actor of its intent's event, which record the columns fixed at
    intent time and the runtime that owns it."""

    state: dict[str, Any]
    hash: str
    intent: dict[str, Any]
    intent_actor: str


@dataclass
class Loaded:
    capabilities: list[Capability] = field(default_factory=list)
    invocations: list[tuple[Invocation, list[tuple[Attempt, Outcome | None]]]] = field(
        default_factory=list
    )
    # Business reference -> {invocation_id: runtime id} of the invocations whose
    # evidence names it (a bounded sample).
    named_by: dict[str, dict[str, int]] = field(default_factory=dict)
    # invocation_id -> the event its row counts as its last (None: it has no such event).
    heads: dict[str, Head | None] = field(default_factory=dict)


class TokenRevoked(Exception):
    """The remembered token a statement was asked to confirm is revoked or gone."""


def _confirmed(token_id: int | None, active: bool | None) -> None:
    if token_id is not None and active is not True:
        raise TokenRevoked


def load(
    *,
    ids: Iterable[str],
    scopes: Iterable[str],
    keys: Iterable[str],
    references: Iterable[str] = (),
    confirm_token: int | None = None,
) -> Loaded:
    scopes = list(scopes)
    capabilities_json, invocations_json, token_active, named_json = _execute(
        LOAD_SQL, [scopes, list(ids), list(keys), confirm_token, list(references)]
    )
    _confirmed(confirm_token, token_active)
    loaded = Loaded(named_by=_json(named_json))
    for entry in _json(capabilities_json):
        capability = _instance(Capability, entry["row"])
        _known[capability.scope] = KnownCapability(capability, entry["fingerprint"])
        _unregistered.pop(capability.scope, None)
        loaded.capabilities.append(capability)
    for scope in {*scopes} - {capability.scope for capability in loaded.capabilities}:
        _remember_unregistered(scope)
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
        head, intent = entry["head"], entry["intent"] or {}
        loaded.heads[invocation.invocation_id] = head and Head(
            head["state"] or {}, head["hash"], intent.get("data") or {}, intent.get("actor", "")
        )
    return loaded


DETAIL_SQL = """
SELECT (
  SELECT json_build_object(
    'invocation', i,
    'attempts', (SELECT coalesce(json_agg(json_build_object('attempt', a, 'outcome',
                   (SELECT row_to_json(o) FROM ledger_outcome o WHERE o.attempt_id = a.id))
                   ORDER BY a.number), '[]')
                 FROM ledger_attempt a WHERE a.invocation_id = i.id),
    'events', (SELECT coalesce(json_agg(e ORDER BY e.seq), '[]')
               FROM ledger_event e
               WHERE e.invocation_id = i.id AND e.invocation_created_at = i.created_at))
  FROM ledger_invocation i
  WHERE i.invocation_id = $1 AND i.runtime_id = $2),
  {token_active}
""".replace("{token_active}", _token_active("$3"))


@dataclass
class Detail:
    invocation: Invocation
    attempts: list[tuple[Attempt, Outcome | None]]
    events: list[Event]


def detail(
    *, invocation_id: str, runtime_id: int, confirm_token: int | None = None
) -> Detail | None:
    """One runtime's invocation with its attempts, outcomes and events, or None."""
    found, token_active = _execute(DETAIL_SQL, [invocation_id, runtime_id, confirm_token])
    _confirmed(confirm_token, token_active)
    if found is None:
        return None
    found = _json(found)
    return Detail(
        invocation=_instance(Invocation, found["invocation"]),
        attempts=[
            (
                _instance(Attempt, pair["attempt"]),
                _instance(Outcome, pair["outcome"]) if pair["outcome"] else None,
            )
            for pair in found["attempts"]
        ],
        events=[_instance(Event, row) for row in found["events"]],
    )


def _json(value: Any) -> Any:
    return msgspec.json.decode(value) if isinstance(value, str | bytes) else value


def _record(obj: object, fields: Sequence[tuple[str, str]]) -> dict[str, Any]:
    return {column: getattr(obj, attname) for column, attname in fields}


def _array(rows: list[dict[str, Any]]) -> str:
    # msgspec writes datetimes in RFC 3339 with full microseconds: the event hashes
    # cover these exact instants. It is several times faster than json.dumps here.
    return _ENCODER.encode(rows).decode()


@dataclass(slots=True)
class PlainEvent:
    """An event as a plain record, cheaper to build than a model: on its way to
    `write`, or read to be verified."""

    seq: int
    kind: str
    actor: str
    data: dict[str, Any]
    created_at: dt.datetime
    prev_hash: str
    hash: str = ""


@dataclass(slots=True)
class NewAttempt:
    """An admitted attempt on its way to `write`, like PlainEvent; `pk` is not known yet."""

    owner: str  # the invocation's invocation_id
    attempt_id: str
    number: int
    admitted_at: dt.datetime
    deadline_at: dt.datetime
    pk: None = None


@dataclass
class Writes:
    new_invocations: list[Invocation]
    updated: list[tuple[Invocation, int]]  # with the event_count that was read
    new_attempts: list[NewAttempt]
    new_outcomes: list[tuple[Outcome, str, str, int | None]]  # owner, attempt_id, attempt pk
    new_events: list[tuple[PlainEvent, str]]  # owner invocation_id
    # (reference, owner invocation_id): references the events name that no one had
    # named when the unit read them. The write fails (RaceLost) if one is named now.
    new_references: list[tuple[str, str]] = field(default_factory=list)
    # Remembered capabilities the unit relied on, by scope: the write fails unless they
    # still read the same (and a scope remembered with none still has none).
    unchanged_capabilities: dict[str, KnownCapability] = field(default_factory=dict)
    # A remembered runtime token: the write fails with TokenRevoked unless it is active.
    confirm_token: int | None = None


def write(writes: Writes) -> None:
    """Write everything or nothing; RaceLost when a concurrent request got there first,
    TokenRevoked when the token it was asked to confirm is no longer active,
    ProjectionBehind when an invocation's row counts fewer events than it has."""
    shape = (
        bool(writes.new_invocations),
        bool(writes.updated),
        bool(writes.new_attempts),
        bool(writes.new_outcomes),
        bool(writes.new_references),
        bool(writes.unchanged_capabilities),
        writes.confirm_token is not None,
    )
    rows: list[list[dict[str, Any]]] = []
    if writes.new_invocations:
        rows.append([_record(row, INVOCATION_FIELDS) for row in writes.new_invocations])
    if writes.updated:
        rows.append([
            {"id": row.pk, "expected": expected, **_record(row, PROJECTION_FIELDS)}
            for row, expected in writes.updated
        ])  # fmt: skip
    if writes.new_attempts:
        rows.append([{"owner": a.owner, **_record(a, ATTEMPT_FIELDS)} for a in writes.new_attempts])
    if writes.new_outcomes:
        rows.append([
            {"owner": owner, "attempt_key": attempt_id, "attempt_pk": attempt_pk,
             **_record(o, OUTCOME_FIELDS)}
            for o, owner, attempt_id, attempt_pk in writes.new_outcomes
        ])  # fmt: skip
    rows.append([{"owner": owner, **_record(e, EVENT_FIELDS)} for e, owner in writes.new_events])
    if writes.new_references:
        rows.append([{"reference": r, "owner": owner} for r, owner in writes.new_references])
    if writes.unchanged_capabilities:
        rows.append([
            {"scope": scope, "fingerprint": known.fingerprint}
            for scope, known in writes.unchanged_capabilities.items()
        ])  # fmt: skip
    params: list[Any] = [*map(_array, rows), *map(len, rows)]
    if writes.confirm_token is not None:
        params.append(writes.confirm_token)
    # Inside a caller's transaction a savepoint contains the failure; on its own the
    # statement is its own transaction (no BEGIN/COMMIT round trips).
    scope = transaction.atomic() if connection.in_atomic_block else nullcontext()
    try:
        with scope:
            _execute(write_sql(*shape), params)
    except DatabaseError as error:
        sqlstate = getattr(error.__cause__, "sqlstate", None)
        if sqlstate in (RACE_LOST_SQLSTATE, DEADLOCK_SQLSTATE):
            raise RaceLost from error
        if sqlstate == TOKEN_REVOKED_SQLSTATE:
            raise TokenRevoked from error
        cause = error.__cause__
        # Raised by the partition's copy of the index: ledger_event_2026_12_event_seq_unique.
        if isinstance(cause, psycopg.errors.UniqueViolation) and (
            (cause.diag.constraint_name or "").endswith("event_seq_unique")
        ):
            raise ProjectionBehind from error
        raise
