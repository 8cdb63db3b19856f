from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html

from ledger import acc, rate_enforcement
from ledger.capabilities import (
    DECLARED_FIELDS,
    SETTINGS,
    awaiting_its_probe,
    capabilities_import,
    capability_settings_change,
)
from ledger.forms import CapabilityImportForm, CapabilitySettingsForm, TokenIssueForm
from ledger.models import Capability, CapabilityDeclaration, Runtime, RuntimeToken
from ledger.probe_config import unconfigured

# What ACC declares is read-only here: it changes only by importing or posting a
# new declaration, which keeps the old one as history.
ACC_FIELDS = ("scope", "version", *DECLARED_FIELDS, "declaration")


class DeclarationInline(admin.TabularInline):
    model = CapabilityDeclaration
    extra = 0
    can_delete = False
    fields = ("version", "created_at", "source", "actor", "declaration")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Capability)
class CapabilityAdmin(admin.ModelAdmin):
    list_display = (
        "scope",
        "version",
        "enabled",
        "risk_level",
        "readonly",
        "idempotency_verified",
        "rate_limit_enforced",
        "audit_sensitive",
        "updated_at",
    )
    list_filter = (
        "enabled",
        "risk_level",
        "readonly",
        "idempotency_verified",
        "rate_limit_enforced",
    )
    search_fields = ("scope",)
    readonly_fields = ACC_FIELDS
    form = CapabilitySettingsForm
    fieldsets = (
        ("ACC declaration (read-only)", {"fields": ACC_FIELDS}),
        ("Ledger settings", {"fields": (*SETTINGS, "reason")}),
    )
    inlines = [DeclarationInline]
    change_list_template = "admin/ledger/capability/change_list.html"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # capabilities come from declarations

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(
        self, request: HttpRequest, obj: Capability, form: CapabilitySettingsForm, change: bool
    ) -> None:
        # Through the registry, which records the change and its reason in the action
        # log (inside the admin's transaction).
        capability_settings_change(
            scope=obj.scope,
            actor=f"user:{request.user.get_username()}",
            reason=form.cleaned_data["reason"],
            **{name: form.cleaned_data[name] for name in SETTINGS},
        )
        obj.refresh_from_db()
        if "rate_limit_enforced" in form.changed_data and obj.rate_limit_enforced:
            self._tell_what_is_enforced(request, obj)
        if "probe" in form.changed_data and obj.probe.get("kind") == "http":
            self.message_user(
                request,
                format_html(
                    "Before its probe settles invocations, ask it about a key you know: on "
                    '<a href="{}">the page of {}</a>.',
                    reverse("capability", args=[obj.scope]),
                    obj.scope,
                ),
                messages.INFO,
            )
        if lacking := unconfigured(obj.probe):
            self.message_user(
                request,
                "Its probe names settings this ledger lacks, so that each of its probes is "
                "inconclusive until they are set: " + "; ".join(lacking) + ".",
                messages.WARNING,
            )
        if obj.has_probe and (waiting := awaiting_its_probe(obj)):
            queue = f"{reverse('console:queue')}?{urlencode({'capability': obj.scope})}"
            self.message_user(
                request,
                format_html(
                    '{} of {} that nobody is on could be settled by its probe now: <a href="{}">'
                    "re-run their probes from the queue</a>.",
                    waiting,
                    obj.scope,
                    queue,
                ),
                messages.WARNING,
            )

    def _tell_what_is_enforced(self, request: HttpRequest, capability: Capability) -> None:
        """What the setting just turned on holds the capability to: the admissions
        already made in the window count against it."""
        window = rate_enforcement.window_of(capability)
        if window is None:
            self.message_user(
                request,
                "Its declaration declares no execution.rate_limit: nothing is enforced "
                "until a declaration that does is registered.",
                messages.WARNING,
            )
            return
        count, span = window.limit.count, window.limit.declared["window"]
        if window.admitted < count:
            self.message_user(
                request,
                f"Enforced from now: {window.admitted} of {count} admissions in the last "
                f"{span} were made already and count against it.",
                messages.INFO,
            )
            return
        # Only the newest `count` are numbered: the window may hold more.
        self.message_user(
            request,
            f"Enforced from now: {count} or more admissions were made in the last {span}, "
            "so its window is full: the next is refused until the oldest of them leaves it.",
            messages.WARNING,
        )

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.import_view)
        return [path("import/", view, name="ledger_capability_import"), *super().get_urls()]

    def import_view(self, request: HttpRequest) -> HttpResponse:
        if not request.user.has_perm("ledger.change_capability"):
            raise PermissionDenied
        form = CapabilityImportForm(request.POST or None, request.FILES or None)
        report = None
        if request.method == "POST" and form.is_valid():
            upload = form.cleaned_data["document"]
            try:
                document = acc.load_document(upload.read())
            except acc.NotAnOpenAPIDocument as exc:
                form.add_error("document", f"{exc}; nothing was imported.")
            else:
                report = capabilities_import(
                    document=document,
                    source=upload.name,
                    actor=f"user:{request.user.get_username()}",
                    dry_run=form.cleaned_data["dry_run"],
                )
                if not form.cleaned_data["dry_run"]:
                    messages.success(
                        request,
                        f"{len(report.registered)} declaration(s) registered, "
                        f"{len(report.skipped)} skipped.",
                    )
        context = {
            **self.admin_site.each_context(request),
            "title": "Import capabilities",
            "opts": self.model._meta,
            "form": form,
            "report": report,
        }
        return TemplateResponse(request, "admin/ledger/capability/import.html", context)


class TokenInline(admin.TabularInline):
    model = RuntimeToken
    extra = 0
    can_delete = False
    fields = ("prefix", "label", "created_at", "revoked_at")
    # A revocation goes through RuntimeToken.revoke (the action below, or
    # `manage.py revoke_token`), which records it; editing the date could also
    # have undone one.
    readonly_fields = ("prefix", "created_at", "revoked_at")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # issued by the runtime's "Issue a token" page, or the command


@admin.register(Runtime)
class RuntimeAdmin(admin.ModelAdmin):
    list_display = ("name", "created_at")
    search_fields = ("name",)
    inlines = [TokenInline]
    actions = ["revoke_tokens"]

    @admin.action(description="Revoke every token of the selected runtimes")
    def revoke_tokens(self, request: HttpRequest, queryset: QuerySet[Runtime]) -> None:
        actor = f"user:{request.user.get_username()}"
        tokens = RuntimeToken.objects.active().filter(runtime__in=queryset)
        revoked = [
            token.prefix
            for token in tokens.select_related("runtime")
            if token.revoke(actor=actor, reason="revoked in the admin")
        ]
        self.message_user(request, f"{len(revoked)} token(s) revoked: {', '.join(revoked)}.")

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.issue_token_view)
        issue = path("<int:runtime_id>/issue-token/", view, name="ledger_runtime_issue_token")
        return [issue, *super().get_urls()]

    def response_add(
        self, request: HttpRequest, obj: Runtime, post_url_continue: str | None = None
    ) -> HttpResponse:
        """A runtime just registered is next given its first token, by one who may."""
        stays = "_addanother" in request.POST or "_continue" in request.POST
        if stays or not request.user.has_perm("ledger.add_runtimetoken"):
            return super().response_add(request, obj, post_url_continue)
        return HttpResponseRedirect(reverse("admin:ledger_runtime_issue_token", args=[obj.pk]))

    def issue_token_view(self, request: HttpRequest, runtime_id: int) -> HttpResponse:
        """A new token for the runtime, shown once on the answer to the POST that issued
        it (never in a message, which the session or a cookie would keep), and never
        stored by the browser's cache; only its hash is kept, as by the command."""
        if not request.user.has_perm("ledger.add_runtimetoken"):
            raise PermissionDenied
        runtime = get_object_or_404(Runtime, pk=runtime_id)
        form = TokenIssueForm(request.POST or None)
        issued = None
        if request.method == "POST" and form.is_valid():
            row, token = RuntimeToken.issue_logged(
                runtime=runtime,
                actor=f"user:{request.user.get_username()}",
                label=form.cleaned_data["label"],
            )
            issued = {"row": row, "token": token}
        context = {
            **self.admin_site.each_context(request),
            "title": f"Issue a token to {runtime.name}",
            "opts": self.model._meta,
            "original": runtime,
            "form": form,
            "issued": issued,
        }
        response = TemplateResponse(request, "admin/ledger/runtime/issue_token.html", context)
        add_never_cache_headers(response)
        return response

    def get_readonly_fields(
        self, request: HttpRequest, obj: Runtime | None = None
    ) -> tuple[str, ...]:
        # The name is the runtime's identity in the audit trail: every event it
        # records names it as actor (`runtime:<name>`), and a rename would orphan
        # them. Web processes also remember it with the runtime's tokens. PostgreSQL
        # refuses a rename too (migration 0018); here the form does not offer one.
        # When it was registered is the ledger's to say, as for tokens.
        return ("name", "created_at") if obj is not None else ("created_at",)
