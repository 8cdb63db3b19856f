from __future__ import annotations

import datetime as dt
import hmac
import json
import logging
from typing import Any

from django.conf import settings
from django.contrib.auth.views import LoginView
from django.core.cache import cache
from django.db import DatabaseError, connection
from django.http import (
    FileResponse,
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views import defaults
from django.views.decorators.http import require_GET
from kombu import Connection
from prometheus_client import CONTENT_TYPE_LATEST

from ledger import anchors, rate_enforcement
from ledger.api.errors import error_body
from ledger.audit import (
    AuditFilterForm,
    action_lines,
    csv_lines,
    export_rows,
    filters_described,
    jsonl_lines,
    page_cursor,
    search,
)
from ledger.bundles import archive_name, bundle_archive
from ledger.capabilities import awaiting_its_probe, called_undeclared, capability_history
from ledger.integrity import (
    CAPABILITY_ADVICE,
    UNEXPLAINED_HISTORY_ADVICE,
    counted,
    more_events_than,
    newest_passes,
    verify,
)
from ledger.metrics import exposition
from ledger.models import AdminAction, Capability, CapabilityDeclaration, Event, RateWatch
from ledger.permissions import ACTORS, READERS, fragment, role_required, roles
from ledger.probe_config import problems, unconfigured

logger = logging.getLogger(__name__)


# Error pages (ledger/urls.py's handlers): a runtime gets the typed error it reads
# everywhere else in the API, never an HTML page; a person gets the page.


def _for_runtime(request: HttpRequest) -> bool:
    return request.path.startswith("/api/")


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _for_runtime(request):
        # Django refused the request before any view (a Host the ledger does not serve).
        return JsonResponse(
            error_body("malformed_request", "The ledger does not accept this request."),
            status=400,
        )
    return defaults.bad_request(request, exception)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if _for_runtime(request):
        return JsonResponse(
            error_body("not_found", "The API has no such endpoint.", {"path": request.path}),
            status=404,
        )
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if _for_runtime(request):
        return JsonResponse(
            error_body(
                "internal_error",
                "The ledger failed while handling this request; the error is in its log. "
                "Evidence is recorded whole or not at all, and every request of this API "
                "replays safely: send the same request again.",
            ),
            status=500,
        )
    return defaults.server_error(request)


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


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus metrics (ledger/metrics.py). With LEDGER_METRICS_TOKEN set, a scrape
    must send it as `Authorization: Bearer …`."""
    expected = settings.LEDGER_METRICS_TOKEN
    if expected:
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(presented.encode(), expected.encode()):
            return HttpResponse("unauthenticated\n", status=401, content_type="text/plain")
    try:
        body = exposition()
    except DatabaseError:
        # Prometheus records the failed scrape as `up` 0: alert on that too.
        logger.warning("metrics: the database is unavailable", exc_info=True)
        return HttpResponse("database unavailable\n", status=503, content_type="text/plain")
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)


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


PAGE = 50


# A search's bundle is built whole (on disk) before it is sent, while the request
# waits; larger ones are an administrator's `manage.py export_bundle`.
BUNDLE_MAX_INVOCATIONS = 1000


@require_GET
@role_required(*READERS)
def audit(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET or None)
    # A filter that does not parse shows its error and no rows, never every row.
    invalid = form.is_bound and not form.is_valid()
    rows = [] if invalid else list(search(form.cleaned_data if form.is_bound else {})[: PAGE + 1])
    more = len(rows) > PAGE
    rows = rows[:PAGE]
    next_query = None
    if more:
        query = request.GET.copy()
        query["after"] = page_cursor(rows[-1])
        next_query = query.urlencode()
    export = request.GET.copy()
    export.pop("after", None)
    context = {
        "form": form,
        "rows": rows,
        "next_query": next_query,
        "export": export.urlencode(),
        "bundle_max": BUNDLE_MAX_INVOCATIONS,
    }
    return render(request, fragment(request, "ledger/audit.html", "results"), context)


@require_GET
@role_required(*READERS)
def audit_export(request: HttpRequest, fmt: str) -> HttpResponse | StreamingHttpResponse:
    if fmt not in ("csv", "jsonl"):
        raise Http404("exports are .csv or .jsonl")
    form = AuditFilterForm(request.GET)
    if not form.is_valid():
        # Exporting everything in place of a filter that did not parse would hand
        # the reviewer the wrong evidence.
        return HttpResponseBadRequest(form.errors.as_text(), content_type="text/plain")
    exported(request, f"{fmt.upper()} of the audit search ({filters_described(form.cleaned_data)})")
    rows = export_rows(form.cleaned_data)
    lines = csv_lines(rows) if fmt == "csv" else jsonl_lines(rows)
    content_type = "text/csv" if fmt == "csv" else "application/x-ndjson"
    response = StreamingHttpResponse(lines, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="ledger-audit.{fmt}"'
    return response


@require_GET
@role_required(*READERS)
def audit_bundle(request: HttpRequest) -> HttpResponse | FileResponse:
    """The evidence bundle of every invocation the search finds, with its verifier."""
    form = AuditFilterForm(request.GET)
    if not form.is_valid():
        return HttpResponseBadRequest(form.errors.as_text(), content_type="text/plain")
    found = search({**form.cleaned_data, "after": None}).order_by().values("pk")
    count = found[: BUNDLE_MAX_INVOCATIONS + 1].count()
    if not 0 < count <= BUNDLE_MAX_INVOCATIONS:
        refusal = (
            "This search finds no invocation: there is nothing to bundle."
            if count == 0
            else f"This search finds more than {BUNDLE_MAX_INVOCATIONS:,} invocations, the "
            "most a bundle from the console holds. Narrow it (a time range, a capability), "
            "or ask an administrator for `manage.py export_bundle`."
        )
        return HttpResponseBadRequest(refusal, content_type="text/plain")
    top = archive_name(f"search-{timezone.now():%Y%m%dT%H%M%S}")
    given = filters_described(form.cleaned_data)
    holding = f"the {counted(count, 'invocation')} an audit search found ({given})"
    return bundle_download(request, top, holding, searched=form.cleaned_data)


def exported(request: HttpRequest, what: str) -> None:
    """Who took evidence out of the ledger, and what: the web's log keeps it."""
    user = request.user.get_username()
    logger.info("evidence exported by=user:%s what=%s", user, json.dumps(what))


def bundle_download(request: HttpRequest, top: str, holding: str, **scope: Any) -> FileResponse:
    """An evidence bundle (`bundle_archive`) sent as `<top>.zip`, streamed from disk."""
    archive = bundle_archive(top, holding, **scope)
    exported(request, f"bundle of {holding}")
    return FileResponse(
        archive, as_attachment=True, filename=f"{top}.zip", content_type="application/zip"
    )


@require_GET
@role_required(*READERS)
def action_log(request: HttpRequest) -> HttpResponse:
    """Every console action: events whose actor is a person, newest first; a request
    that acted on many invocations alike is one line."""
    events = Event.objects.filter(actor__startswith="user:").select_related("invocation")
    declarations = CapabilityDeclaration.objects.select_related("capability")
    after = request.GET.get("after", "")
    lines, next_after = action_lines(
        events, before=int(after) if after.isdigit() else None, lines=PAGE
    )
    context = {
        "lines": lines,
        "next_after": next_after,
        "declarations": declarations.order_by("-created_at")[:PAGE],
        "admin_actions": AdminAction.objects.order_by("-created_at")[:PAGE],
    }
    return render(request, "ledger/actions.html", context)


# Long enough to catch a capability called weekly; short enough that the page reads
# a week of undeclared intents, not the whole history.
UNDECLARED_WINDOW = dt.timedelta(days=7)


@require_GET
@role_required(*READERS)
def capability_list(request: HttpRequest) -> HttpResponse:
    """Every capability with what governs its invocations now, and the scopes
    runtimes called lately without one."""
    context = {
        "capabilities": Capability.objects.order_by("scope"),
        "undeclared": called_undeclared(timezone.now() - UNDECLARED_WINDOW),
        "undeclared_days": UNDECLARED_WINDOW.days,
    }
    return render(request, "ledger/capabilities.html", context)


@require_GET
@role_required(*READERS)
def capability_page(request: HttpRequest, scope: str) -> HttpResponse:
    """One capability: its declaration and settings in force, and how they came to be."""
    capability = get_object_or_404(Capability, scope=scope)
    context = {
        "capability": capability,
        "rate_window": rate_enforcement.window_of(capability),
        "history": capability_history(scope),
        "declarations": capability.declarations.order_by("-version"),
        "rate_watch": RateWatch.objects.filter(scope=scope).first(),
        "awaiting_probe": awaiting_its_probe(capability) if capability.has_probe else "",
        # A probe saved before a check it now fails runs all the same; what it cannot
        # conclude is said here, and when an administrator saves it next.
        "probe_problems": problems(capability.probe),
        "probe_unconfigured": unconfigured(capability.probe),
        "can_try_probe": capability.has_probe and bool(roles(request.user) & set(ACTORS)),
        "defaults": {
            "timeout_ms": settings.LEDGER_DEFAULT_TIMEOUT_MS,
            "grace_ms": settings.LEDGER_DEFAULT_GRACE_MS,
            "max_attempts": settings.LEDGER_DEFAULT_MAX_ATTEMPTS,
        },
    }
    return render(request, "ledger/capability.html", context)


# Anchors the Verify page lists.
ANCHORS_SHOWN = 20


@require_GET
@role_required(*READERS)
def audit_verify(request: HttpRequest) -> HttpResponse:
    """Recompute chains, replay them, and check seals and projections for a time range,
    in the browser.

    A range that does not parse is shown as an error and nothing is verified: the
    reviewer must never take the whole ledger's answer for the range they typed.
    """
    form = AuditFilterForm(request.GET or None)
    report, too_many = None, None
    if "run" in request.GET and form.is_valid():
        since, until = form.cleaned_data.get("since"), form.cleaned_data.get("until")
        # A web request must not read the whole of a large ledger: past the limit,
        # the reviewer narrows the range or runs the command.
        limit = settings.LEDGER_VERIFY_PAGE_MAX_EVENTS
        if more_events_than(limit, since=since, until=until):
            too_many = limit
        else:
            report = verify(since=since, until=until, projections=True)
    running, finished = newest_passes()
    context = {
        "form": form,
        "report": report,
        "too_many": too_many,
        "unexplained_history_advice": UNEXPLAINED_HISTORY_ADVICE,
        "capability_advice": CAPABILITY_ADVICE,
        "running": running,
        "finished": finished,
        "anchor": anchors.newest() if report and report.ok else None,
        "anchors": anchors.sent(ANCHORS_SHOWN),
    }
    return render(request, "ledger/verify.html", context)
