from __future__ import annotations

from typing import Any

from django.core.cache import caches
from rest_framework.request import Request
from rest_framework.throttling import SimpleRateThrottle


class RuntimeTokenThrottle(SimpleRateThrottle):
    """Per-token request rate (LEDGER_THROTTLE_RATE); 429 with Retry-After past it.

    Counted in each web process's memory (see CACHES in settings).
    """

    scope = "runtime"
    cache = caches["local"]

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        token = request.auth
        if token is None:
            return None
        return f"throttle:runtime-token:{token.pk}"
