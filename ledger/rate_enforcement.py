"""Declared rate limits enforced at admission, for the capabilities an admin chose.

ACC v1 lets a capability declare `execution.rate_limit` (`count` per `window`): a
sliding window, by the ledger's clock, across every runtime (the limit is the business
system's). The ledger watches every declared limit (`ledger.rate_limits`). For a
capability whose `rate_limit_enforced` setting is on, it also refuses: a unit of
evidence that would admit one of its attempts takes the capability's lock for its
transaction, and an admission that would make more than `count` within the window is
refused with 429 `rate_limited` and the seconds until one leaves the window, and
changes nothing. Admissions are numbered under the lock (`RateAdmission`, kept for
these capabilities only, the newest `count` of each), so that judging one reads one
row, the admission `count` numbers before it (`Room`), however large the limit. Units
of other capabilities neither wait nor read: the one-statement write path is theirs
as before.

When the limit a capability is held to changes (enforcement turned on, or a new
declaration while it is on), its admissions are numbered anew from the evidence
(`renumber`): those made within the window before enforcement began count against the
first window as much as the ones after.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.db.models import Count, Q
from django.utils import timezone

from ledger.models import Capability, Event, RateAdmission

# The advisory lock of a capability's admissions, with its scope after it.
LOCK = "ledger.rate_limit:"

WINDOW = re.compile(r"^([1-9][0-9]*)([smhd])$")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


@dataclass(frozen=True)
class RateLimit:
    count: int
    window: dt.timedelta
    declared: Mapping[str, Any]
    # When the declaration that set it was registered.
    since: dt.datetime | None = None

    @classmethod
    def declared_by(cls, declaration: Mapping[str, Any]) -> RateLimit | None:
        """The rate limit an ACC declaration sets, or None. Declarations are valid
        against the schema when registered, which fixes the shape read here."""
        execution = declaration.get("execution")
        declared = execution.get("rate_limit") if isinstance(execution, Mapping) else None
        if not isinstance(declared, Mapping):
            return None
        match = WINDOW.match(str(declared.get("window", "")))
        count = declared.get("count")
        if match is None or type(count) is not int or count < 1:
            return None
        window = dt.timedelta(**{UNITS[match[2]]: int(match[1])})
        return cls(count=count, window=window, declared=dict(declared))


@dataclass
class Room:
    """Whether an enforced limit has room for a unit's next admissions of a capability.

    Admissions are numbered in order under the capability's lock. The next one has
    room unless the one `count` numbers before it was made within the window before
    now: then it would be the `count + 1`th in the window. So each admission reads one
    earlier one, however large the limit: `earlier` holds the times, by number, of
    those the unit's admissions may read, its own added as it makes them, which `made`
    keeps for `record_admissions`."""

    scope: str
    limit: RateLimit
    next: int
    earlier: dict[int, dt.datetime]
    made: list[tuple[int, dt.datetime, str, str]] = field(default_factory=list)

    def _counted_against(self) -> dt.datetime | None:
        return self.earlier.get(self.next - self.limit.count)

    def full(self, now: dt.datetime) -> bool:
        before = self._counted_against()
        return before is not None and before > now - self.limit.window

    def take(self, at: dt.datetime, invocation_id: str, attempt_id: str) -> int:
        """The number of the admission made now, of this attempt."""
        number, self.next = self.next, self.next + 1
        self.earlier[number] = at
        self.made.append((number, at, invocation_id, attempt_id))
        return number

    def refusal(self, now: dt.datetime) -> dict[str, Any]:
        """The details of a refusal: the limit, and the whole seconds until the
        admission counted against this one leaves the window (at least one)."""
        before = self._counted_against()
        assert before is not None, "refused only when full"
        leaves = before + self.limit.window
        return {
            "capability": self.scope,
            "rate_limit": dict(self.limit.declared),
            "retry_after_seconds": max(1, math.ceil((leaves - now).total_seconds())),
        }


def enforced_limits(capabilities: Iterable[Capability | None]) -> dict[str, RateLimit]:
    """The declared limits of those capabilities whose limit the ledger enforces."""
    return {
        capability.scope: limit
        for capability in capabilities
        if capability is not None
        and capability.rate_limit_enforced
        and (limit := RateLimit.declared_by(capability.declaration)) is not None
    }


def enforced_limit(capability: Capability) -> RateLimit | None:
    return enforced_limits([capability]).get(capability.scope)


# The unit's lock is taken by a statement of its own: a statement's snapshot is taken
# as it starts, before a lock it waits for, and would miss what the holder committed.
LOCKED = "SELECT pg_advisory_xact_lock(hashtext(%s))"
# The newest number, and the admissions from `count` before the next one on, as many
# as the unit may read: one row each, found through the (scope, number) index.
EARLIER = """
WITH newest AS (
  SELECT coalesce(max(number), 0) AS number FROM ledger_rateadmission WHERE scope = %(scope)s
)
SELECT newest.number, a.number, a.admitted_at FROM newest
LEFT JOIN LATERAL (
  SELECT number, admitted_at FROM ledger_rateadmission
  WHERE scope = %(scope)s AND number > newest.number - %(count)s
  ORDER BY number LIMIT %(most)s
) a ON true
"""
# The unit's admissions kept, and the capability's older than the newest `count` let go.
KEPT = """
WITH gone AS (
  DELETE FROM ledger_rateadmission WHERE scope = %(scope)s AND number <= %(last)s - %(count)s
)
INSERT INTO ledger_rateadmission (scope, number, admitted_at, invocation_id, attempt_id)
SELECT %(scope)s, number, admitted_at, invocation_id, attempt_id
FROM unnest(%(numbers)s::bigint[], %(times)s::timestamptz[], %(invocations)s::text[],
            %(attempts)s::text[]) AS a(number, admitted_at, invocation_id, attempt_id)
"""


def rooms(limits: Mapping[str, RateLimit], most: Mapping[str, int]) -> dict[str, Room]:
    """Each capability's lock, held to the end of the caller's transaction, and the
    earlier admissions that the unit's next ones (`most` of them at most, by scope)
    are judged by: a read of the unit's size, not the limit's.

    Taken in scope order, so that two units never hold one each and wait for the
    other's."""
    found = {}
    with connection.cursor() as cursor:
        for scope in sorted(limits):
            limit = limits[scope]
            cursor.execute(LOCKED, [LOCK + scope])
            cursor.execute(EARLIER, {"scope": scope, "count": limit.count, "most": most[scope]})
            rows = cursor.fetchall()
            earlier = {number: at for _, number, at in rows if number is not None}
            found[scope] = Room(scope, limit, rows[0][0] + 1, earlier)
    return found


def record_admissions(rooms: Mapping[str, Room]) -> None:
    """The admissions a unit made under enforced limits, for the next units to read;
    of each capability only the newest `count` are kept, all a next one may read."""
    with connection.cursor() as cursor:
        for scope in sorted(scope for scope, room in rooms.items() if room.made):
            room = rooms[scope]
            numbers, times, invocations, attempts = zip(*room.made, strict=True)
            cursor.execute(
                KEPT,
                {
                    "scope": scope,
                    "last": room.next - 1,
                    "count": room.limit.count,
                    "numbers": list(numbers),
                    "times": list(times),
                    "invocations": list(invocations),
                    "attempts": list(attempts),
                },
            )


@dataclass(frozen=True)
class Window:
    scope: str
    limit: RateLimit
    # The admissions the limit counts now: at `limit.count`, the next is refused.
    admitted: int


def windows_now() -> list[Window]:
    """Each enforced limit's window as it stands now, by scope: one statement for all
    of them (/metrics)."""
    limits = enforced_limits(Capability.objects.filter(rate_limit_enforced=True))
    if not limits:
        return []
    since = timezone.now()
    counted = Q()
    for scope, limit in limits.items():
        counted |= Q(scope=scope, admitted_at__gt=since - limit.window)
    rows = RateAdmission.objects.filter(counted).values_list("scope").annotate(Count("id"))
    admitted = dict(rows)
    return [Window(scope, limit, admitted.get(scope, 0)) for scope, limit in sorted(limits.items())]


def window_of(capability: Capability) -> Window | None:
    """The capability's enforced window as it stands now (None: no limit enforced). The
    admissions in it are all among the newest `count` kept, since no more than `count`
    are ever admitted in a window."""
    limit = enforced_limit(capability)
    if limit is None:
        return None
    since = timezone.now() - limit.window
    admitted = RateAdmission.objects.filter(scope=capability.scope, admitted_at__gt=since)
    return Window(capability.scope, limit, admitted.count())


def renumber(scope: str, limit: RateLimit | None) -> None:
    """Number the capability's admissions anew, for the limit it is now held to (None:
    none): the newest `count` made within its window, read from their
    `attempt_admitted` events, become the numbers a next admission is judged by.

    Called in the transaction that changes the limit, under the capability's lock, so
    no enforced admission is numbered meanwhile. An admission whose unit read the
    capability before the change committed and wrote after this read is not counted:
    the rate watch still judges it."""
    with connection.cursor() as cursor:
        cursor.execute(LOCKED, [LOCK + scope])
    RateAdmission.objects.filter(scope=scope).delete()
    if limit is None:
        return
    # Through event_created_at: the events of one window, not every admission made.
    recent = (
        Event.objects.filter(
            kind="attempt_admitted",
            created_at__gt=timezone.now() - limit.window,
            invocation__capability_scope=scope,
        )
        .order_by("-created_at", "-id")
        .values_list("created_at", "invocation__invocation_id", "data__attempt_id")
    )[: limit.count]
    RateAdmission.objects.bulk_create(
        RateAdmission(
            scope=scope, number=number, admitted_at=at, invocation_id=invocation, attempt_id=attempt
        )
        for number, (at, invocation, attempt) in enumerate(reversed(recent), start=1)
    )
