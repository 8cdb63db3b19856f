"""One shape for every refusal: `{"error": {"type", "message", "details"}}`."""

from __future__ import annotations

import logging
from typing import Any

from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from ledger.api.parsers import PayloadTooLarge
from ledger.db.errors import unavailable
from ledger.services import LedgerError

log = logging.getLogger(__name__)


def error_body(type: str, message: str, details: Any = None) -> dict[str, Any]:
    return {"error": {"type": type, "message": message, "details": details or {}}}


def ledger_unavailable_body() -> dict[str, Any]:
    return error_body(
        "ledger_unavailable",
        "The ledger database is unreachable. Nothing was recorded; it is safe to send "
        "the same request again.",
    )


def _details(detail: Any) -> Any:
    if isinstance(detail, dict):
        return {key: _details(value) for key, value in detail.items()}
    if isinstance(detail, list):
        return [_details(value) for value in detail]
    return str(detail)


# DRF exception class → (HTTP status, error type); first match wins.
TYPED = [
    (exceptions.ParseError, "malformed_request"),
    (exceptions.ValidationError, "validation_failed"),
    (exceptions.NotAuthenticated, "unauthenticated"),
    (exceptions.AuthenticationFailed, "unauthenticated"),
    (exceptions.Throttled, "rate_limited"),
    (exceptions.NotFound, "not_found"),
    (exceptions.MethodNotAllowed, "method_not_allowed"),
    (exceptions.UnsupportedMediaType, "unsupported_media_type"),
    (exceptions.NotAcceptable, "not_acceptable"),
    (PayloadTooLarge, "payload_too_large"),
    (exceptions.PermissionDenied, "forbidden"),
]


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, LedgerError):
        refused = Response(error_body(exc.type, exc.message, exc.details), status=exc.status)
        if (wait := exc.details.get("retry_after_seconds")) is not None:
            refused["Retry-After"] = str(wait)  # a capability's enforced rate limit
        return refused
    if unavailable(exc):
        log.warning("ledger_unavailable error=%r", exc)
        return Response(ledger_unavailable_body(), status=503)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    response = drf_exception_handler(exc, context)
    if response is None or not isinstance(exc, exceptions.APIException):
        return response
    type_ = next((name for cls, name in TYPED if isinstance(exc, cls)), "error")
    if isinstance(exc, exceptions.ValidationError):
        message = "The request has invalid fields; see details."
        details = _details(exc.detail)
        if not isinstance(details, dict):
            details = {"non_field_errors": details}
    else:
        message = str(exc.detail)
        details = {}
    wait = getattr(exc, "wait", None)
    if isinstance(exc, exceptions.Throttled) and wait is not None:
        details = {"retry_after_seconds": int(wait) + 1}
    response.data = error_body(type_, message, details)
    return response
