"""The evidence statements' plans find rows by index, whatever the planner knows.

Each connection prepares these statements once and keeps their generic plan while
the tables grow. A plan that scans ledger_invocation sequentially costs nothing on
an empty table and a millisecond per few thousand invocations later, on every
request, so it must never be chosen: not even here, where the tables are nearly
empty and have never been analyzed (the generic plan is made under exactly those
conditions when a ledger starts fresh).
"""

from __future__ import annotations

import itertools
import re

import pytest
from django.db import connection
from django.utils import timezone

from ledger import store
from ledger.models import Capability
from reconciliation import sweeper
from tests.conftest import Api

pytestmark = pytest.mark.django_db

WRITE_SHAPES = [
    shape
    for shape in itertools.product([False, True], repeat=7)
    if shape[0] or shape[1]  # a unit writes a new invocation or updates one
]


def generic_plan(sql: str) -> str:
    placeholders = len(set(re.findall(r"\$(\d+)", sql)))
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE evidence_statement AS {sql}")
        try:
            cursor.execute(
                f"EXPLAIN EXECUTE evidence_statement({', '.join(['NULL'] * placeholders)})"
            )
            return "\n".join(line for (line,) in cursor.fetchall())
        finally:
            cursor.execute("DEALLOCATE evidence_statement")


@pytest.mark.parametrize(
    "sql",
    [
        pytest.param(store.LOAD_SQL, id="load"),
        pytest.param(store.DETAIL_SQL, id="detail"),
        *(pytest.param(store.write_sql(*shape), id=f"write{shape}") for shape in WRITE_SHAPES),
    ],
)
def test_no_sequential_scan_of_the_evidence_tables(sql: str) -> None:
    plan = generic_plan(sql)

    assert re.findall(r"Seq Scan on ledger_\w+", plan) == [], plan


def test_an_idempotency_key_is_looked_up_with_its_scope() -> None:
    """Both halves of the unique (scope, key) index: not every invocation of the scope."""
    plan = generic_plan(store.LOAD_SQL)

    conditions = re.findall(r"Index Scan using invocation_scope_key_unique .*\n\s+(.*)", plan)
    assert conditions, plan
    assert all("capability_scope" in c and "idempotency_key" in c for c in conditions), plan


def test_only_the_evidence_statements_are_prepared(api: Api, refund: Capability) -> None:
    """ORM queries are planned with their values each time: their generic plan could
    not use a partial index whose predicate a parameter decides (the sweeper's)."""
    for _ in range(10):
        sweeper.overdue_invocation_ids(now=timezone.now(), limit=10)
    assert api.intent(attempt_id="a1")[0] == 201

    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [statement for (statement,) in cursor.fetchall()]

    assert any("ledger_assert_written" in statement for statement in prepared), prepared
    assert not any("deadline_at" in s and "LIMIT" in s for s in prepared), prepared
