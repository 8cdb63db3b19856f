"""Template filters of the console pages (operator and audit)."""

from __future__ import annotations

import datetime as dt

from django import template
from django.utils import timezone
from django.utils.timesince import timesince

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
