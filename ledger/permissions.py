"""Console roles (groups) and the view helpers both console apps use."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

ROLES = ("operator", "approver", "compliance", "admin")
READERS = ROLES
ACTORS = ("operator", "approver", "admin")


def roles(user: Any) -> set[str]:
    if user.is_superuser:
        return set(ROLES)
    return set(user.groups.values_list("name", flat=True)) & set(ROLES)


def role_required(*allowed: str) -> Callable[..., Any]:
    """Logged in (else to the login page) and in one of the roles (else 403)."""

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        @login_required
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not roles(request.user) & set(allowed):
                raise PermissionDenied
            return view(request, *args, **kwargs)

        return wrapped

    return decorator


def wants_fragment(request: HttpRequest) -> bool:
    """Whether htmx asked for a part of the page to swap in (a boosted link asks for
    the whole page)."""
    htmx = getattr(request, "htmx", None)
    return bool(htmx and not htmx.boosted)


def fragment(request: HttpRequest, template: str, name: str) -> str:
    """The partial for an htmx request, the whole page otherwise."""
    return f"{template}#{name}" if wants_fragment(request) else template
