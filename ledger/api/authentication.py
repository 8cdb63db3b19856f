from __future__ import annotations

from typing import Any, ClassVar

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from ledger import store
from ledger.models import Runtime, RuntimeToken

# One message for unknown, malformed and revoked tokens: nothing to probe.
UNKNOWN_OR_REVOKED = "The token is unknown or revoked."


class RuntimeTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer ilr_<prefix>_<secret>`; request.user is the Runtime.

    With `remember=True` a token this process has read before is not read again.
    Reading it cost every request a statement: 0.23 ms of an intent's 1.7 ms
    (in-process). Instead, the request's own statement confirms it: the services pass
    `runtime.unconfirmed_token_id` to `store.load`, `store.write` or `store.detail`,
    which check in that same statement that the token is still unrevoked; a revoked
    token writes nothing and is answered 401. So a revocation still takes effect at
    once, in every process. Only views whose statements all do this remember
    (`StatementConfirmedView`), and a request that ends before any statement (a 400,
    say) has its token read at the end.

    One class for both, so that the OpenAPI schema has one security scheme.
    """

    keyword = "Bearer"

    # prefix -> (token id, digest, runtime id, runtime name), as read from the
    # database: only active tokens get here, so the tokens issued bound its size.
    remembered: ClassVar[dict[str, tuple[int, str, int, str]]] = {}

    def __init__(self, *, remember: bool = False) -> None:
        self.remember = remember

    def authenticate(self, request: Request) -> tuple[Runtime, RuntimeToken] | None:
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <runtime token>'.")
        prefix = RuntimeToken.split(token)
        row = self.find(prefix) if prefix else None
        if row is None or not row.matches(token):
            raise exceptions.AuthenticationFailed(UNKNOWN_OR_REVOKED)
        return row.runtime, row

    def find(self, prefix: str) -> RuntimeToken | None:
        """The active token with this prefix, with its runtime."""
        known = self.remembered.get(prefix) if self.remember else None
        if known is None:
            row = store.active_token(prefix)
            if row is not None and self.remember:
                self.remembered[prefix] = (row.pk, row.digest, row.runtime.pk, row.runtime.name)
            return row
        token_id, digest, runtime_id, runtime_name = known
        runtime = Runtime(id=runtime_id, name=runtime_name)
        runtime.unconfirmed_token_id = token_id
        return RuntimeToken(id=token_id, prefix=prefix, digest=digest, runtime=runtime)

    @classmethod
    def forget(cls, prefix: str) -> None:
        cls.remembered.pop(prefix, None)

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
