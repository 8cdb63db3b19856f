"""Django's PostgreSQL backend, except that a pooled connection PostgreSQL has dropped
is never lent.

A restart or a failover of PostgreSQL drops every connection the web processes and
workers hold in their pools, and each would fail the first statement sent on it: an
API request answered 503, a console page, a sweep. A dropped connection has
PostgreSQL's farewell and the end of its stream waiting on its socket, which a look
finds without a round trip (psycopg_pool's own `check` costs one, and waits a second
before its second retry). So each connection the pool lends is looked at first; a
dropped one goes back to the pool, which discards it, and another is taken. A statement
that fails after it was sent is never sent again.
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
from django.db.backends.postgresql import base


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        connection = super().get_new_connection(conn_params)
        pool = self.pool
        if pool is None:
            return connection
        for _ in range(pool.max_size):
            if not dropped_while_idle(connection):
                break
            pool.putconn(connection)
            connection = super().get_new_connection(conn_params)
        return connection


def dropped_while_idle(connection: psycopg.Connection[Any]) -> bool:
    if connection.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return False
    # Read whatever waits: a dropped connection's farewell first, then the end of the
    # stream, which libpq reports as an error. An idle live connection has at most a
    # notice waiting, and nothing after it.
    for _ in range(3):
        if not select.select([connection.fileno()], [], [], 0)[0]:
            break
        try:
            connection.pgconn.consume_input()
        except psycopg.OperationalError:
            return True
    return connection.pgconn.status == psycopg.pq.ConnStatus.BAD
