"""Declared rate limits enforced at admission, for the capabilities an admin chose.

ACC v1 lets a capability declare `execution.rate_limit` (`count` per `window`): a
sliding window, by the ledger's clock, across every runtime (the limit is the business
system's). The ledger watches every declared limit (`ledger.rate_limits`). For a
capability whose `rate_limit_enforced` setting is on, it also refuses: a unit of
evidence that would admit one of its attempts takes the capability's lock for its
transaction and reads the newest admissions within the window (`RateAdmission`, kept
for these capabilities only); an admission that would make more than `count` is
refused with 429 `rate_limited` and the seconds until one leaves the window, and
changes nothing. Units of other capabilities neither wait nor read: the one-statement
write path is theirs as before.
"""

from __future__ import annotations

import bisect
import datetime as dt
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connection

from ledger.models import Capability, RateAdmission

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
    """What an enforced limit leaves a unit of evidence: the times of the newest
    admissions of the capability within its window, at most `count`, oldest first, the
    unit's own included as it admits them."""

    scope: str
    limit: RateLimit
    recent: list[dt.datetime]

    def full(self) -> bool:
        return len(self.recent) >= self.limit.count

    def take(self, at: dt.datetime) -> None:
        bisect.insort(self.recent, at)
        del self.recent[: -self.limit.count]

    def refusal(self, now: dt.datetime) -> dict[str, Any]:
        """The details of a refusal: the limit, and the whole seconds until the oldest
        of the newest `count` admissions leaves the window (at least one)."""
        leaves = self.recent[0] + self.limit.window
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


def rooms(limits: Mapping[str, RateLimit], now: dt.datetime) -> dict[str, Room]:
    """Each capability's lock, held to the end of the caller's transaction, and the
    newest admissions within its window, which its next admissions are judged by.

    Taken in scope order, so that two units never hold one each and wait for the
    other's. Counted from `now - window` on, with no end: an admission of a unit that
    read the clock after this one, and took the lock first, counts too."""
    found = {}
    for scope in sorted(limits):
        limit = limits[scope]
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [LOCK + scope])
        recent = RateAdmission.objects.filter(scope=scope, admitted_at__gt=now - limit.window)
        newest = recent.order_by("-admitted_at").values_list("admitted_at", flat=True)
        found[scope] = Room(scope, limit, list(newest[: limit.count])[::-1])
    return found


def record_admissions(admitted: Sequence[RateAdmission], rooms: Mapping[str, Room]) -> None:
    """The admissions a unit made under enforced limits, for the next units to count;
    and, of those capabilities, the rows too old to count again are let go."""
    if not admitted:
        return
    RateAdmission.objects.bulk_create(admitted)
    for scope in {admission.scope for admission in admitted}:
        oldest_counted = admitted[0].admitted_at - 2 * rooms[scope].limit.window
        RateAdmission.objects.filter(scope=scope, admitted_at__lt=oldest_counted).delete()
