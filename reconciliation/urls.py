from __future__ import annotations

from django.urls import path

from reconciliation import views

app_name = "console"
urlpatterns = [
    path("", views.queue, name="queue"),
    path("queue/counts", views.queue_counts, name="queue-counts"),
    path("dashboard/", views.dashboard, name="dashboard"),
    path("invocations/<str:invocation_id>/", views.invocation_page, name="invocation"),
    path("invocations/<str:invocation_id>/resolve", views.resolve, name="resolve"),
    path(
        "invocations/<str:invocation_id>/approve",
        views.decide,
        {"decision": "approve"},
        name="approve",
    ),
    path(
        "invocations/<str:invocation_id>/reject",
        views.decide,
        {"decision": "reject"},
        name="reject",
    ),
    path("invocations/<str:invocation_id>/claim", views.assign, {"take": True}, name="claim"),
    path("invocations/<str:invocation_id>/release", views.assign, {"take": False}, name="release"),
    path("invocations/<str:invocation_id>/probe", views.probe_now, name="probe"),
]
