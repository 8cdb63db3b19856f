from __future__ import annotations

from django.urls import path, register_converter

from reconciliation import views


class StoredId:
    """An invocation id as stored: "/" included, since ids recorded before the API
    refused it must stay reachable (and `str` could not even link to them), but never
    NUL, which PostgreSQL cannot compare with: such a path is simply not found."""

    regex = r"[^\x00]+"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(StoredId, "stored_id")

app_name = "console"
urlpatterns = [
    path("", views.queue, name="queue"),
    path("queue/counts", views.queue_counts, name="queue-counts"),
    path("queue/probes", views.rerun_probes, name="queue-probes"),
    path("dashboard/", views.dashboard, name="dashboard"),
    path("audit/capabilities/<str:scope>/probe-try", views.probe_try, name="probe-try"),
    path("invocations/<stored_id:invocation_id>/", views.invocation_page, name="invocation"),
    path(
        "invocations/<stored_id:invocation_id>/bundle.zip",
        views.invocation_bundle,
        name="bundle",
    ),
    path("invocations/<stored_id:invocation_id>/resolve", views.resolve, name="resolve"),
    path(
        "invocations/<stored_id:invocation_id>/approve",
        views.decide,
        {"decision": "approve"},
        name="approve",
    ),
    path(
        "invocations/<stored_id:invocation_id>/reject",
        views.decide,
        {"decision": "reject"},
        name="reject",
    ),
    path("invocations/<stored_id:invocation_id>/claim", views.assign, {"take": True}, name="claim"),
    path(
        "invocations/<stored_id:invocation_id>/release",
        views.assign,
        {"take": False},
        name="release",
    ),
    path("invocations/<stored_id:invocation_id>/probe", views.probe_now, name="probe"),
    path("invocations/<stored_id:invocation_id>/restore", views.restore, name="restore"),
]
