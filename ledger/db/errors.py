"""What a database error says of the database: unreachable, or a statement refused."""

from __future__ import annotations

import psycopg
from django.db import DatabaseError, InterfaceError, OperationalError
from psycopg_pool import PoolTimeout

# What the API answers 503 `ledger_unavailable` for, and the console its 503 page.
UNAVAILABLE = (OperationalError, InterfaceError, PoolTimeout)

# SQLSTATE classes of a connection PostgreSQL cannot serve: 08, connection exception;
# 57, operator intervention (a server shut down, crashed or starting), but for 57014,
# a statement cancelled (its timeout), which the connection survives.
LOST_CLASSES = ("08", "57")
CANCELLED = "57014"


def unavailable(exc: BaseException) -> bool:
    """Whether the database could not serve the request: unreachable, the connection
    lost, no pooled connection in time, or the transaction given up (a deadlock, a
    timeout). Whatever the request wrote was rolled back with it."""
    return isinstance(exc, UNAVAILABLE) or (
        isinstance(exc, DatabaseError) and isinstance(exc.__cause__, UNAVAILABLE)
    )


def connection_lost(exc: BaseException) -> bool:
    """Whether PostgreSQL could not be reached or the connection broke (the server
    down, restarting or killed), as opposed to a statement it refused or gave up."""
    if isinstance(exc, InterfaceError | PoolTimeout):
        return True
    cause = exc.__cause__ if isinstance(exc, DatabaseError) else exc
    if isinstance(cause, psycopg.InterfaceError):
        return True
    if not isinstance(cause, psycopg.OperationalError):
        return False
    state = cause.sqlstate
    return state is None or (state[:2] in LOST_CLASSES and state != CANCELLED)
