from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from ledger import store
from ledger.models import Runtime, RuntimeToken


class RuntimeTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer ilr_<prefix>_<secret>`; request.user is the Runtime."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Runtime, RuntimeToken] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <runtime token>'.")
        prefix = RuntimeToken.split(token)
        row = store.active_token(prefix) if prefix else None
        # One message for unknown, malformed and revoked tokens: nothing to probe.
        if row is None or not row.matches(token):
            raise exceptions.AuthenticationFailed("The token is unknown or revoked.")
        return row.runtime, row

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class RuntimeTokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """Tells drf-spectacular how runtimes authenticate."""

    target_class = RuntimeTokenAuthentication
    name = "runtimeToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A runtime token from `manage.py create_runtime`.",
        }
