from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.views import LoginView
from django.core.cache import cache
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
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


class ThrottledLoginView(LoginView):
    """Django's login, refusing a username/address pair after repeated failures."""

    template_name = "registration/login.html"
    redirect_authenticated_user = True
    max_failures = 5
    window_seconds = 300

    def _key(self) -> str:
        username = self.request.POST.get("username", "")[:150].lower()
        return f"login-failures:{self.request.META.get('REMOTE_ADDR', '')}:{username}"

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if cache.get(self._key(), 0) >= self.max_failures:
            form = self.get_form()
            form.errors.clear()
            form.add_error(None, "Too many failed attempts; wait a few minutes and try again.")
            return self.render_to_response(self.get_context_data(form=form), status=429)
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form: Any) -> HttpResponse:
        key = self._key()
        cache.add(key, 0, self.window_seconds)
        cache.incr(key)
        return super().form_invalid(form)
