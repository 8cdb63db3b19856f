"""The event table's month partitions (migration 0033), made ahead of the months.

An event goes to the partition of the month its invocation was recorded in. Beat
makes each month's partition `MONTHS_AHEAD` months before it begins, through
`ledger_create_event_partitions`, which runs with the rights of the role that
migrated, so the web and worker role needs none. Should beat stop for longer than
that, nothing is refused: new invocations' events go to `ledger_event_default`, and
/metrics says so (`ledger_events_unpartitioned`, `ledger_event_partitions_ahead`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db import connection
from django.utils import timezone

MONTHS_AHEAD = 3
DEFAULT_PARTITION = "ledger_event_default"
# /metrics counts the events in the default partition up to this many: enough to
# alert on, and a bounded read however many beat's absence left there.
UNPARTITIONED_COUNTED = 1000


def month_partition(at: dt.datetime, *, months_later: int = 0) -> str:
    """The name of the partition for the UTC month `months_later` months after `at`'s,
    as ledger_create_event_partitions names it."""
    month = at.astimezone(dt.UTC).year * 12 + at.astimezone(dt.UTC).month - 1 + months_later
    return f"ledger_event_{month // 12:04d}_{month % 12 + 1:02d}"


def create_event_partitions(
    *, since: dt.datetime | None = None, months_ahead: int = MONTHS_AHEAD
) -> list[str]:
    """Makes the month partitions missing from `since`'s month (now's, by default)
    through `months_ahead` months after now's; returns the names of those it made.

    A month whose events are in the default partition already gets none (PostgreSQL
    logs a warning naming it): they stay where they are, and are read as any others.
    """
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT ledger_create_event_partitions(%s, %s + make_interval(months => %s))",
            [since or now, now, months_ahead],
        )
        (made,) = cursor.fetchone()
    return list(made)


@dataclass(frozen=True)
class PartitionState:
    """How far ahead the month partitions reach, and what missed them."""

    # Month partitions for months after the current one (UTC).
    months_ahead: int
    # Events in the default partition, counted up to UNPARTITIONED_COUNTED.
    unpartitioned: int


PARTITION_STATE_SQL = f"""
SELECT
  (SELECT count(*) FROM pg_inherits JOIN pg_class c ON c.oid = pg_inherits.inhrelid
   WHERE pg_inherits.inhparent = 'ledger_event'::regclass
     AND c.relname ~ '^ledger_event_[0-9]{{4}}_[0-9]{{2}}$'
     AND c.relname > 'ledger_event_' || to_char(%s AT TIME ZONE 'UTC', 'YYYY_MM')),
  (SELECT count(*) FROM (SELECT FROM {DEFAULT_PARTITION} LIMIT {UNPARTITIONED_COUNTED}) d)
"""  # noqa: S608 (the module's own constants)


def partition_state(now: dt.datetime | None = None) -> PartitionState:
    with connection.cursor() as cursor:
        cursor.execute(PARTITION_STATE_SQL, [now or timezone.now()])
        months_ahead, unpartitioned = cursor.fetchone()
    return PartitionState(months_ahead=months_ahead, unpartitioned=unpartitioned)
