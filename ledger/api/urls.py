from __future__ import annotations

from django.urls import path

from ledger.api import views

app_name = "api"
urlpatterns = [
    path("intents", views.IntentView.as_view(), name="intents"),
    path("evidence", views.EvidenceView.as_view(), name="evidence"),
    path("capabilities", views.CapabilityView.as_view(), name="capabilities"),
    path("invocations", views.InvocationListView.as_view(), name="invocations"),
    path(
        "invocations/<str:invocation_id>",
        views.InvocationDetailView.as_view(),
        name="invocation",
    ),
    path(
        "invocations/<str:invocation_id>/attempts",
        views.AttemptView.as_view(),
        name="attempts",
    ),
    path(
        "invocations/<str:invocation_id>/attempts/<str:attempt_id>/outcome",
        views.OutcomeView.as_view(),
        name="outcome",
    ),
]
