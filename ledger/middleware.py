"""The console's answer when PostgreSQL cannot be reached."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string

from ledger.db.errors import unavailable

log = logging.getLogger(__name__)


class DatabaseUnavailableMiddleware:
    """A 503 page that says nothing was changed, instead of a bare server error.

    The runtime API answers its own typed 503 (`ledger_unavailable`); this covers the
    console and the admin. The page is rendered without the request's context, whose
    user and messages would need the database.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not unavailable(exception):
            return None
        log.warning("database unavailable path=%s error=%r", request.path, exception)
        response = HttpResponse(render_to_string("503.html"), status=503)
        response["Retry-After"] = "30"
        return response
