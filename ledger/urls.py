from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.views import LogoutView
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from ledger import views

urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
    path("readyz", views.readyz, name="readyz"),
    path("metrics", views.metrics, name="metrics"),
    path("api/v1/", include("ledger.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="docs"),
    path("admin/", admin.site.urls),
    path("accounts/login/", views.ThrottledLoginView.as_view(), name="login"),
    path("accounts/logout/", LogoutView.as_view(), name="logout"),
    path("audit/", views.audit, name="audit"),
    path("audit/actions/", views.action_log, name="audit-actions"),
    path("audit/verify/", views.audit_verify, name="audit-verify"),
    path("audit/capabilities/", views.capability_list, name="capabilities"),
    path("audit/capabilities/<str:scope>/", views.capability_page, name="capability"),
    path("audit/export.<str:fmt>", views.audit_export, name="audit-export"),
    path("audit/bundle.zip", views.audit_bundle, name="audit-bundle"),
    path("", include("reconciliation.urls")),
]

handler400 = views.bad_request
handler404 = views.page_not_found
handler500 = views.server_error
