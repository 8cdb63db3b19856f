"""The operator console: queue, invocation page, actions and dashboard.

One view serves a page and its htmx fragment; every action is a POST that goes
through reconciliation.services and re-renders its fragment (or redirects without
JavaScript). Permissions are checked here, never only in templates.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.core.cache import cache
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Min, Value
from django.http import FileResponse, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST
from kombu.exceptions import OperationalError as KombuOperationalError

from ledger import chain, policy, rate_enforcement
from ledger.audit import invocations_naming
from ledger.bundles import archive_name
from ledger.capabilities import awaiting_its_probe, probes_concluding_nothing
from ledger.integrity import restore_projection
from ledger.metrics import (
    background_work,
    probe_run_counts,
    probe_runs_per_capability,
    reopened_claim_counts,
)
from ledger.models import (
    FLAGGED_STATUSES,
    MAX_RISK_RANK,
    NAMES_A_SHARED_REFERENCE,
    RISK_FIRST,
    RISK_RANK,
    Capability,
    Event,
    Invocation,
    Row,
)
from ledger.partitions import UNPARTITIONED_COUNTED
from ledger.permissions import ACTORS, READERS, fragment, role_required, roles, wants_fragment
from ledger.services import (
    LedgerError,
    disagreement,
    event_body,
    rows_disagreeing,
    with_heads,
)
from ledger.templatetags.console import as_json
from ledger.views import bundle_download
from reconciliation import probes, services
from reconciliation.forms import (
    DecisionForm,
    ProbeTryForm,
    QueueFilterForm,
    QueuePosition,
    ResolveForm,
    RestoreForm,
)
from reconciliation.tasks import reconcile_invocation, request_probes

log = logging.getLogger(__name__)


def actor(request: HttpRequest) -> str:
    return f"user:{request.user.get_username()}"


# The queue --------------------------------------------------------------------


QUEUE_PAGE = 100


def queue_position(invocation: Invocation) -> QueuePosition:
    """Where this row stands in the queue's order, for the next page to start after."""
    # invocation_flagged_has_flagged_at: PostgreSQL keeps every flagged row timed.
    assert invocation.flagged_at is not None
    rank = RISK_RANK.get(invocation.risk_level, MAX_RISK_RANK)
    return QueuePosition(rank, invocation.flagged_at, invocation.pk)


def queue_rows(form: QueueFilterForm, user: Any) -> list[Invocation]:
    """The flagged invocations the filter selects, riskiest first, then oldest, from
    where the last page ended; at most QUEUE_PAGE + 1 of them, the extra one only to
    tell that there is a next page.

    A filter that does not parse selects nothing and is shown as an error, as in the
    audit search: an operator must never take the whole queue for a filtered one.
    """
    if form.is_bound and not form.is_valid():
        return []
    flagged = Invocation.objects.flagged()
    data = form.cleaned_data if form.is_bound else {}
    if data.get("runtime"):
        flagged = flagged.of_runtime_named(data["runtime"])
    # Each row with its last event and its intent's, to mark the rows changed outside
    # the ledger (`rows_disagreeing`); PostgreSQL reads them for the page's rows only.
    rows = (
        with_heads(flagged)
        .select_related("runtime")
        .annotate(risk_rank=RISK_FIRST)
        .order_by("risk_rank", "flagged_at", "id")
    )
    if data.get("capability"):
        rows = rows.filter(capability_scope=data["capability"])
    if data.get("risk"):
        # Said of the rank too, which invocation_queue_order starts with.
        rank = RISK_RANK.get(data["risk"], MAX_RISK_RANK)
        rows = rows.filter(risk_level=data["risk"], risk_rank=rank)
    if data.get("cause"):
        rows = rows.filter(cause=data["cause"])
    if data.get("older_than_minutes"):
        cutoff = timezone.now() - dt.timedelta(minutes=data["older_than_minutes"])
        rows = rows.filter(flagged_at__lte=cutoff)
    if data.get("mine") == "mine":
        rows = rows.filter(assignee=user.get_username())
    elif data.get("mine") == "unclaimed":
        rows = rows.filter(assignee="")
    if after := data.get("after"):
        # Keyset, not OFFSET: an invocation resolved while the operator reads a page
        # neither hides nor repeats one on the next. A row comparison, which the queue's
        # indexes bound exactly: a page reads a page however deep in the queue it is.
        rows = rows.alias(position=Row("risk_rank", "flagged_at", "id")).filter(
            position__gt=Row(Value(after.risk_rank), Value(after.flagged_at), Value(after.pk))
        )
    # Sorted in SQL before the limit: a high-risk invocation must never be cut off
    # behind hundreds of older low-risk ones.
    return list(rows[: QUEUE_PAGE + 1])


def status_counts() -> dict[str, int]:
    counted = dict(
        Invocation.objects.flagged().values_list("status").annotate(n=Count("id")).order_by()
    )
    return {status: counted.get(status, 0) for status in FLAGGED_STATUSES}


def probes_to_offer(form: QueueFilterForm, user: Any) -> dict[str, Any] | None:
    """With the queue filtered by a capability that has a probe, to a person who may
    act: how many of its escalated invocations the probe could settle now."""
    scope = form.cleaned_data.get("capability") if form.is_bound and form.is_valid() else None
    if not scope or not roles(user) & set(ACTORS):
        return None
    capability = Capability.objects.filter(scope=scope).first()
    if capability is None or not capability.has_probe:
        return None
    waiting = awaiting_its_probe(capability)
    if not waiting:
        return None
    return {
        "capability": scope,
        "waiting": waiting,
        "requested_by": cache.get(probes_requested_key(scope)),
    }


def probes_requested_key(scope: str) -> str:
    """The shared cache's key for a request to re-run a capability's probes."""
    return f"probes-requested:{scope}"


@require_GET
@role_required(*READERS)
def queue(request: HttpRequest) -> HttpResponse:
    form = QueueFilterForm(request.GET or None)
    rows = queue_rows(form, request.user)
    next_query = None
    if len(rows) > QUEUE_PAGE:
        query = request.GET.copy()
        query["after"] = str(queue_position(rows[QUEUE_PAGE - 1]))
        next_query = query.urlencode()
    first_query = request.GET.copy()
    first_query.pop("after", None)
    context = {
        "form": form,
        "rows": rows[:QUEUE_PAGE],
        # Nothing is taken for them until an admin restores them: the page says so.
        "changed_outside": rows_disagreeing(rows[:QUEUE_PAGE]),
        "next_query": next_query,
        "first_query": first_query.urlencode() if "after" in request.GET else None,
        # Counted for the whole page only: the rows alone, which a filter or a next page
        # swaps in, do not show them (they refresh on their own).
        "counts": {} if wants_fragment(request) else status_counts(),
        "probes": probes_to_offer(form, request.user),
    }
    return render(request, fragment(request, "reconciliation/queue.html", "queue-rows"), context)


PROBES_REQUESTED_SECONDS = 60


@require_POST
@role_required(*ACTORS)
def rerun_probes(request: HttpRequest) -> HttpResponse:
    """Re-run the probe of every escalated invocation of a capability that it could
    settle (after the probe was added, or the business system is back). A worker
    records each as this person's request and queues its job: thousands are too many
    for one request."""
    scope = request.POST.get("capability", "")
    back = redirect(f"{reverse('console:queue')}?{urlencode({'capability': scope})}")
    if not scope:
        messages.error(request, "Name the capability whose probes should run again.")
        return back
    capability = Capability.objects.filter(scope=scope).first()
    if capability is None or not capability.has_probe:
        messages.error(request, f"{scope} has no probe to run.")
        return back
    waiting = awaiting_its_probe(capability)
    if not waiting:
        messages.error(request, f"No escalated invocation of {scope} waits for its probe.")
        return back
    # One request a capability at a time, whoever clicks: a second, before the worker
    # has claimed the first's invocations, would record each request twice.
    if not cache.add(probes_requested_key(scope), actor(request), PROBES_REQUESTED_SECONDS):
        by = cache.get(probes_requested_key(scope)) or "someone"
        messages.error(request, f"{by} asked for these probes a moment ago; they are queued.")
        return back
    try:
        request_probes.delay(scope, actor(request))
    except KombuOperationalError as exc:
        log.warning("probes not queued capability=%s error=%s", scope, exc)
        cache.delete(probes_requested_key(scope))
        messages.error(
            request,
            "The probes are not queued: the task broker is unreachable. Nothing was "
            "recorded; try again once the broker is back.",
        )
        return back
    messages.success(
        request,
        f"Probes requested for the {waiting} of "
        f"{scope} that its probe could settle: each records your request, and the queue "
        "shows what they find.",
    )
    return back


@require_GET
@role_required(*READERS)
def queue_counts(request: HttpRequest) -> HttpResponse:
    return render(request, "reconciliation/queue.html#counts", {"counts": status_counts()})


# One invocation ---------------------------------------------------------------


def timeline(invocation: Invocation) -> list[dict[str, Any]]:
    """Every event with whether its link in the chain verifies."""
    entries, prev = [], chain.GENESIS_HASH
    for event in Event.objects.of(invocation).order_by("seq"):
        computed = chain.event_hash(event.prev_hash, event_body(event, invocation.invocation_id))
        entries.append(
            {"event": event, "verified": event.prev_hash == prev and computed == event.hash}
        )
        prev = event.hash
    return entries


def probe_run_row(event: Event) -> dict[str, Any]:
    """A probe_run event as the page shows it. Without a probe (no finding) the event
    holds no request, answer or timing: the invocation was handed to people."""
    data = event.data
    request = data.get("request") or {}
    return {
        "try": data.get("try_number"),
        "when": event.created_at,
        "finding": data.get("finding") or "no probe: handed to a person",
        "business_reference": data.get("business_reference"),
        "url": request.get("url"),
        "answer": _answer(request, data.get("detail"), data.get("retry_after")),
        "duration_ms": data.get("duration_ms"),
    }


def _answer(asked: dict[str, Any], detail: str | None, retry_after: float | None) -> str:
    """The answer's status with the rule that decided it, or why none did (`no rule
    matched…`, `misconfigured…`), and the wait it asked for: a bare 404 beside
    "inconclusive" left the operator to guess."""
    shown = " — ".join(str(part) for part in (asked.get("status"), detail) if part)
    if rule := asked.get("rule"):
        shown += f" — {_rule_text(rule)}"
    if retry_after:
        shown += f" (asked to wait {retry_after:g} s)"
    return shown


def _rule_text(rule: dict[str, Any]) -> str:
    """`absent rule: error = "refund_not_found"`, as a person reads a rule."""
    if "json_path" in rule and "equals" in rule:
        says = f"{rule['json_path']} = {json.dumps(rule['equals'])}"
    elif "json_path" in rule:
        says = f"{rule['json_path']} in the answer"
    else:
        says = f"a reference at {rule.get('reference_path')}"
    return f"{rule['name']} rule: {says}"


# How many other invocations the page names for one business reference; the audit
# search it links to lists them all.
SHARED_REFERENCE_LIMIT = 10

REFERENCE_SOURCES = {
    "outcome_recorded": "outcome",
    "late_outcome_recorded": "late outcome",
    "outcome_conflict": "conflicting outcome claim",
    "probe_run": "probe",
    "resolution": "resolution",
    "resolution_approved": "approved resolution",
}


def business_references(invocation: Invocation, events: list[Event]) -> list[dict[str, Any]]:
    """Each business reference this invocation's evidence names, where it was named,
    and the other invocations whose evidence names it too.

    One reference on two invocations is what an operator must see before resolving:
    either one effect is being counted for two intents, or a reference was mistyped.
    """
    named: dict[str, list[str]] = {}
    for event in events:
        reference = event.data.get("business_reference")
        if isinstance(reference, str) and reference:
            source = REFERENCE_SOURCES.get(event.kind, event.kind.replace("_", " "))
            if event.data.get("proposal") is True:
                source = "proposed resolution"
            if source not in named.setdefault(reference, []):
                named[reference].append(source)
    references = []
    for reference, sources in named.items():
        elsewhere = invocations_naming(
            reference, besides=invocation.invocation_id, limit=SHARED_REFERENCE_LIMIT + 1
        )
        references.append(
            {
                "reference": reference,
                "sources": sources,
                "elsewhere": elsewhere[:SHARED_REFERENCE_LIMIT],
                "more_elsewhere": len(elsewhere) > SHARED_REFERENCE_LIMIT,
            }
        )
    return references


def invocation_context(request: HttpRequest, invocation: Invocation) -> dict[str, Any]:
    user_roles = roles(request.user)
    flagged = invocation.status in FLAGGED_STATUSES
    seen = {"seen_event_count": invocation.event_count}
    proposal = invocation.proposal or {}
    events = timeline(invocation)
    recorded = [e["event"] for e in events]
    disagreeing = disagreement(invocation, recorded, invocation.runtime)
    state = invocation.state()
    return {
        "references": business_references(invocation, recorded),
        "invocation": invocation,
        # An attempt awaiting its outcome past its deadline, not yet flagged.
        "overdue": invocation.deadline_at is not None and invocation.deadline_at <= timezone.now(),
        "arguments": as_json(invocation.arguments),
        "has_probe": has_probe(invocation),
        "state": state,
        "flags": [(flag, policy.FLAG_MEANINGS[flag]) for flag in sorted(state.flags)],
        "timeline": events,
        "disagreement": disagreeing,
        "can_restore": bool(disagreeing) and "admin" in user_roles,
        "restore_form": RestoreForm(),
        "attempts": invocation.attempts.select_related("outcome").order_by("number"),
        "probe_runs": [probe_run_row(e["event"]) for e in events if e["event"].kind == "probe_run"],
        "can_act": flagged and bool(user_roles & set(ACTORS)),
        "can_decide": invocation.status == policy.Status.RESOLUTION_PROPOSED
        and bool(user_roles & {"approver", "admin"})
        and proposal.get("proposed_by") != actor(request),
        "resolve_form": ResolveForm(initial=seen),
        "decision_form": DecisionForm(initial=seen),
        "seen": invocation.event_count,
    }


def _invocation(invocation_id: str) -> Invocation:
    return get_object_or_404(
        Invocation.objects.select_related("runtime", "capability"), invocation_id=invocation_id
    )


def has_probe(invocation: Invocation) -> bool:
    """Whether its capability names a probe now (the reconcile task reads it when it
    runs): the one it was recorded under, or declared under its scope since. Without
    one, people decide."""
    capability = invocation.probed_by()
    return capability is not None and capability.has_probe


@require_GET
@role_required(*READERS)
def invocation_page(request: HttpRequest, invocation_id: str) -> HttpResponse:
    invocation = _invocation(invocation_id)
    template = fragment(request, "reconciliation/invocation.html", "detail")
    return render(request, template, invocation_context(request, invocation))


@require_GET
@role_required(*READERS)
def invocation_bundle(request: HttpRequest, invocation_id: str) -> FileResponse:
    """The invocation's evidence bundle, with the verifier that checks it offline."""
    invocation = _invocation(invocation_id)
    return bundle_download(
        request,
        archive_name(invocation.invocation_id),
        f"invocation {invocation.invocation_id}",
        invocation_id=invocation.invocation_id,
    )


def _after_action(request: HttpRequest, invocation_id: str, done: str) -> HttpResponse:
    messages.success(request, done)
    if request.htmx:  # type: ignore[attr-defined]
        invocation = _invocation(invocation_id)
        return render(
            request,
            "reconciliation/invocation.html#detail",
            invocation_context(request, invocation),
        )
    # 303 See Other: the browser follows a POST's answer with a GET (POST/redirect/GET).
    response = redirect("console:invocation", invocation_id=invocation_id)
    response.status_code = 303
    return response


def _refused(request: HttpRequest, invocation_id: str, error: LedgerError) -> HttpResponse:
    messages.error(request, error.message)
    response = _after_action(request, invocation_id, "")
    if request.htmx:  # type: ignore[attr-defined]
        response.status_code = 409
    return response


def _seen(request: HttpRequest) -> int | None:
    raw = request.POST.get("seen_event_count", "")
    return int(raw) if raw.isdigit() else None


@require_POST
@role_required(*ACTORS)
def resolve(request: HttpRequest, invocation_id: str) -> HttpResponse:
    form = ResolveForm(request.POST)
    if not form.is_valid():
        return _form_again(request, invocation_id, "resolve_form", form)
    try:
        result = services.invocation_resolve(
            invocation_id=invocation_id,
            actor=actor(request),
            effect=policy.Effect(form.cleaned_data["effect"]),
            business_reference=form.cleaned_data["business_reference"],
            note=form.cleaned_data["note"],
            seen_event_count=form.cleaned_data["seen_event_count"],
            shared_reference_confirmed=form.cleaned_data["same_reference_confirmed"],
        )
    except services.SharedReference as shared:
        form.refuse_shared(shared.reference, shared.also_named_by)
        return _form_again(request, invocation_id, "resolve_form", form)
    except LedgerError as error:
        return _refused(request, invocation_id, error)
    done = (
        "Proposed; a second person must approve it."
        if result.status == policy.Status.RESOLUTION_PROPOSED
        else f"Resolved: {result.status}."
    )
    return _after_action(request, invocation_id, done)


def _form_again(
    request: HttpRequest, invocation_id: str, name: str, form: forms.Form
) -> HttpResponse:
    """The page's form of that name with its errors, in place; nothing was applied."""
    context = invocation_context(request, _invocation(invocation_id))
    context[name] = form
    status = 200 if request.htmx else 400  # type: ignore[attr-defined]
    return render(request, "reconciliation/invocation.html#detail", context, status=status)


@require_POST
@role_required("approver", "admin")
def decide(request: HttpRequest, invocation_id: str, decision: str) -> HttpResponse:
    form = DecisionForm(request.POST)
    form.is_valid()  # every field is optional here; a missing count skips the stale check
    note = form.cleaned_data.get("note", "")
    try:
        if decision == "approve":
            services.invocation_approve(
                invocation_id=invocation_id, actor=actor(request), note=note,
                seen_event_count=_seen(request),
                shared_reference_confirmed=form.cleaned_data.get("same_reference_confirmed", False),
            )  # fmt: skip
        else:
            services.invocation_reject(
                invocation_id=invocation_id, actor=actor(request), note=note,
                seen_event_count=_seen(request),
            )  # fmt: skip
    except services.SharedReference as shared:
        form.refuse_shared(shared.reference, shared.also_named_by)
        return _form_again(request, invocation_id, "decision_form", form)
    except LedgerError as error:
        if error.type == "same_person":
            raise PermissionDenied(error.message) from None
        return _refused(request, invocation_id, error)
    return _after_action(request, invocation_id, f"Proposal {decision}d.")


@require_POST
@role_required(*ACTORS)
def assign(request: HttpRequest, invocation_id: str, take: bool) -> HttpResponse:
    try:
        services.invocation_assign(
            invocation_id=invocation_id, actor=actor(request), take=take,
            seen_event_count=_seen(request),
        )  # fmt: skip
    except LedgerError as error:
        return _refused(request, invocation_id, error)
    return _after_action(request, invocation_id, "You are on it." if take else "Released.")


@require_POST
@role_required(*ACTORS)
def probe_now(request: HttpRequest, invocation_id: str) -> HttpResponse:
    invocation = _invocation(invocation_id)
    if invocation.status not in (
        policy.Status.RECONCILIATION_REQUIRED,
        policy.Status.ESCALATED,
    ):
        messages.error(request, f"The invocation is {invocation.status}; no probe to run.")
        return _after_action(request, invocation_id, "")
    if not has_probe(invocation):
        messages.error(request, "Its capability has no probe; resolve it below.")
        return _after_action(request, invocation_id, "")
    try:
        reconcile_invocation.delay(invocation_id, force=True)
    except KombuOperationalError as exc:
        log.warning("probe not queued invocation=%s error=%s", invocation_id, exc)
        services.probe_requested(invocation_id=invocation_id, actor=actor(request), queued=False)
        messages.error(
            request,
            "The probe is not queued: the task broker is unreachable. Your request is "
            "recorded; try again once the broker is back.",
        )
        return _after_action(request, invocation_id, "")
    services.probe_requested(invocation_id=invocation_id, actor=actor(request), queued=True)
    return _after_action(request, invocation_id, "Probe queued; this page shows its result.")


@require_POST
@role_required("admin")
def restore(request: HttpRequest, invocation_id: str) -> HttpResponse:
    """Put a row changed outside the ledger back from its events, on the record: what
    `manage.py restore_projection` does, from the page that shows the row broken."""
    _invocation(invocation_id)  # 404 for an unknown one
    form = RestoreForm(request.POST)
    if not form.is_valid():
        return _form_again(request, invocation_id, "restore_form", form)
    try:
        restored = restore_projection(
            invocation_id=invocation_id, actor=actor(request), reason=form.cleaned_data["reason"]
        )
    except LedgerError as error:
        return _refused(request, invocation_id, error)
    if not restored:
        return _after_action(
            request, invocation_id, "It agrees with its events already; nothing was written."
        )
    return _after_action(
        request, invocation_id, f"Restored from its events: {', '.join(sorted(restored))}."
    )


# The dashboard -----------------------------------------------------------------


STATUS_COUNTS_SECONDS = 60


def counts_by_status() -> dict[str, Any]:
    """Every invocation counted by status, and when. Counting reads the whole table
    (half a million rows took 150 ms here), so it runs at most once a minute, shared
    by every operator through the cache; the flagged counts elsewhere are exact."""

    def count() -> dict[str, Any]:
        rows = Invocation.objects.values("status").annotate(n=Count("id")).order_by("status")
        return {"rows": list(rows), "at": timezone.now()}

    counted = cache.get_or_set("dashboard:by_status", count, STATUS_COUNTS_SECONDS)
    return counted if counted is not None else count()


PROBED_CAPABILITIES_SHOWN = 20


@require_GET
@role_required(*READERS)
def dashboard(request: HttpRequest) -> HttpResponse:
    hour_ago = timezone.now() - dt.timedelta(hours=1)
    context = {
        "by_status": counts_by_status(),
        "oldest": Invocation.objects.flagged().aggregate(oldest=Min("flagged_at"))["oldest"],
        "by_capability": Invocation.objects.flagged()
        .values("capability_scope")
        .annotate(n=Count("id"))
        .order_by("-n")[:20],
        "probes": probe_runs_per_capability(probe_run_counts(hour_ago))[:PROBED_CAPABILITIES_SHOWN],
        "reopened_claims": reopened_claim_counts(hour_ago),
        "probes_concluding_nothing": probes_concluding_nothing(),
        "rate_windows": rate_enforcement.windows_now(),
        "shared_references": Event.objects.filter(
            NAMES_A_SHARED_REFERENCE, created_at__gte=hour_ago
        ).count(),
        "work": background_work(),
        "unpartitioned_counted": UNPARTITIONED_COUNTED,
    }
    return render(request, "reconciliation/dashboard.html", context)


@require_POST
@role_required(*ACTORS)
def probe_try(request: HttpRequest, scope: str) -> HttpResponse:
    """Ask a capability's probe about a key, as a reconciliation would, and show
    what its rules conclude; nothing is recorded. Whoever has just written a probe
    sees at once whether it finds a refund they know of, and whether a
    mistyped URL's 404 would have passed for "absent"."""
    capability = get_object_or_404(Capability, scope=scope)
    form = ProbeTryForm(request.POST)
    tried: probes.ProbeResult | None = None
    problem = ""
    if not capability.has_probe:
        problem = "This capability has no probe to try: its flagged invocations go to a person."
    elif form.is_valid():
        key = form.cleaned_data["idempotency_key"]
        try:
            tried = services.probe_tried(capability, key, actor(request))
        except probes.ProbeConfigError as exc:
            problem = f"The probe is misconfigured: {exc}"
    context = {
        "capability": capability,
        "form": form,
        "tried": tried,
        "answer": tried and _answer(tried.summary, tried.detail, tried.retry_after),
        "problem": problem,
    }
    return render(request, fragment(request, "reconciliation/probe_try.html", "result"), context)
