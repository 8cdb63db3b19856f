from __future__ import annotations

from rest_framework import authentication, exceptions
from rest_framework.request import Request

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
        row = (
            RuntimeToken.objects.active().select_related("runtime").filter(prefix=prefix).first()
            if prefix
            else None
        )
        # One message for unknown, malformed and revoked tokens: nothing to probe.
        if row is None or not row.matches(token):
            raise exceptions.AuthenticationFailed("The token is unknown or revoked.")
        return row.runtime, row

    def authenticate_header(self, request: Request) -> str:
        return self.keyword
