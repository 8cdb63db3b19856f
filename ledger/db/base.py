"""Django's PostgreSQL backend, except that a pooled connection PostgreSQL has dropped
is never lent.

A restart or a failover of PostgreSQL drops every connection the web processes and
workers hold in their pools, and each would fail the first statement sent on it: an
API request answered 503, a console page, a sweep. A dropped connection has
PostgreSQL's farewell and the end of its stream waiting on its socket, which reading
it finds without a round trip (psycopg_pool's own `check` costs one, and waits a second
before its second retry). So what waits on each connection the pool lends is read
first; a dropped one goes back to the pool, which discards it, and another is taken. A statement
that fails after it was sent is never sent again.
"""

from __future__ import annotations

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
    pgconn = connection.pgconn
    if pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE or not pgconn.nonblocking:
        return False
    # psycopg keeps its socket nonblocking, so reading what waits never waits: half a
    # microsecond, no system call that would let another thread take the GIL (a
    # select() here cost the 8-client benchmark 0.2 ms of CPU per request). A dropped
    # connection has its farewell and then the end of the stream waiting, and the
    # second read reports the end as an error; a live idle one has nothing, or a notice.
    try:
        pgconn.consume_input()
        pgconn.consume_input()
    except psycopg.OperationalError:
        return True
    return pgconn.status == psycopg.pq.ConnStatus.BAD
