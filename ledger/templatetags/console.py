"""Template filters of the console pages (operator and audit)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from django import template
from django.utils import timezone
from django.utils.timesince import timesince, timeuntil

from ledger.chain import redact

register = template.Library()


@register.filter
def waited(since: dt.datetime | None) -> str:
    """How long since then, as Django's `timesince` says it, except that the first
    minute reads "under a minute" rather than "0 minutes"."""
    if since is None:
        return ""
    if timezone.now() - since < dt.timedelta(minutes=1):
        return "under a minute"
    return timesince(since)


@register.filter
def ahead(until: dt.datetime | None) -> str:
    """How long until then, as Django's `timeuntil` says it, except that the last
    minute reads "under a minute" rather than "0 minutes"."""
    if until is None:
        return ""
    if until - timezone.now() < dt.timedelta(minutes=1):
        return "under a minute"
    return timeuntil(until)


@register.filter
def as_json(value: Any) -> str | None:
    """Stored JSON as people read it: indented, keys sorted, non-ASCII as written."""
    if value is None:
        return None
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


@register.filter
def masked(value: Any) -> Any:
    """A copy with secret-looking keys' values masked, as stored arguments are."""
    return redact(value)
