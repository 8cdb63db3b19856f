from __future__ import annotations

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET
from kombu import Connection


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """The process is up; says nothing of its dependencies (see /readyz)."""
    return JsonResponse({"status": "ok"})


def _database_ready() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".strip()
    return None


def _broker_ready() -> str | None:
    try:
        broker = Connection(
            settings.CELERY_BROKER_URL,
            transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS,
            connect_timeout=2,
        )
        with broker:
            broker.ensure_connection(max_retries=1, timeout=2)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".strip()
    return None


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    """Ready to take evidence: the database and the broker both answer."""
    checks = {"database": _database_ready(), "broker": _broker_ready()}
    body = {
        "status": "ok" if not any(checks.values()) else "unavailable",
        "checks": {name: error or "ok" for name, error in checks.items()},
    }
    return JsonResponse(body, status=200 if body["status"] == "ok" else 503)
