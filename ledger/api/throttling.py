from __future__ import annotations

import functools
import math
import threading
import time
from typing import Any, ClassVar

from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.throttling import BaseThrottle

PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@functools.cache
def parse_rate(rate: str) -> tuple[int, int]:
    """`"50000/min"` as (requests, seconds), read as DRF reads its rates."""
    requests, period = rate.split("/")
    return int(requests), PERIODS[period[0]]


class RuntimeTokenThrottle(BaseThrottle):
    """Per-token request rate (LEDGER_THROTTLE_RATE); 429 with Retry-After past it.

    A token may spend its whole allowance at once and earns it back evenly over the
    period (the generic cell rate algorithm): each token keeps one instant, the time
    at which its allowance is full again. DRF's SimpleRateThrottle keeps the time of
    every request in the period instead, and copies that list through the cache on
    each request; at the default 50,000/min that cost 0.7 ms a request once a busy
    runtime had 16,000 of them.

    Counted in each web process's memory (see CACHES in settings).
    """

    rate: ClassVar[str] = str(api_settings.DEFAULT_THROTTLE_RATES["runtime"])
    _full_again_at: ClassVar[dict[int, float]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self.retry_after: float | None = None

    @classmethod
    def reset(cls) -> None:
        with cls._lock:
            cls._full_again_at.clear()

    def allow_request(self, request: Request, view: Any) -> bool:
        token = request.auth
        if token is None:
            return True
        requests, period = parse_rate(self.rate)
        spacing = period / requests
        now = time.monotonic()
        with self._lock:
            full_again_at = max(self._full_again_at.get(token.pk, now), now) + spacing
            if full_again_at - now > period:
                self.retry_after = full_again_at - now - period
                return False
            self._full_again_at[token.pk] = full_again_at
        return True

    def wait(self) -> float | None:
        # Retry-After is whole seconds: round up, so that the retry is let in.
        return math.ceil(self.retry_after) if self.retry_after is not None else None
