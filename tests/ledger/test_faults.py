"""The database refuses to lose or rewrite evidence, and an unreachable or dying
database costs the runtime a typed 503, never a half-written record."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from logging import WARNING
from typing import Any

import httpx
import psycopg
import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.db.utils import IntegrityError, InternalError, ProgrammingError
from django.test import Client

from ledger import services
from ledger.celery import app
from ledger.db.errors import connection_lost
from ledger.models import (
    AdminAction,
    Attempt,
    Capability,
    CapabilityDeclaration,
    Event,
    Invocation,
)
from reconciliation import views
from reconciliation.tasks import sweep_overdue_attempts
from tests.conftest import Api, intent_body


@pytest.mark.parametrize(
    "table", ["ledger_event", "ledger_attempt", "ledger_outcome", "ledger_namedreference"]
)
@pytest.mark.parametrize("statement", ["UPDATE {table} SET {key} = {key}", "DELETE FROM {table}"])
def test_postgres_refuses_to_rewrite_evidence(
    api: Api, refund: Capability, table: str, statement: str
) -> None:
    api.intent(attempt_id="a1")
    api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    key = "reference" if table == "ledger_namedreference" else "id"
    with (
        pytest.raises((InternalError, ProgrammingError), match="append-only"),
        connection.cursor() as cursor,
    ):
        cursor.execute(statement.format(table=table, key=key))


@pytest.mark.parametrize("table", ["ledger_adminaction", "ledger_capabilitydeclaration"])
@pytest.mark.parametrize(
    "statement", ["UPDATE {table} SET actor = 'cli:eve'", "DELETE FROM {table}"]
)
def test_postgres_refuses_to_rewrite_what_administrators_did(
    refund: Capability, table: str, statement: str
) -> None:
    AdminAction.record(actor="cli:ada", action="token_issued", target="runtime a, token 1")
    CapabilityDeclaration.objects.create(
        capability=refund, version=2, declaration={}, source="test", actor="cli:ada"
    )
    with (
        pytest.raises((InternalError, ProgrammingError), match="append-only"),
        connection.cursor() as cursor,
    ):
        cursor.execute(statement.format(table=table))


def admin_conninfo() -> str:
    settings = connection.settings_dict
    return psycopg.conninfo.make_conninfo(
        host=settings["HOST"],
        port=settings["PORT"] or 5432,
        user=settings["USER"],
        dbname=settings["NAME"],
    )


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_database_answers_503_ledger_unavailable(
    api: Api, refund: Capability, unreachable_database: None
) -> None:
    status, body = api.intent(attempt_id="a1")
    assert status == 503
    assert body["error"]["type"] == "ledger_unavailable"
    assert "safe to send the same request again" in body["error"]["message"]


def database_error(query: Callable[[], object]) -> Exception:
    with pytest.raises(Exception) as raised:
        query()
    connection.close()  # as Django's request and task ends close a failed connection
    return raised.value


@pytest.mark.django_db(transaction=True)
def test_a_lost_connection_is_told_from_a_statement_postgres_refused(
    refund: Capability, request: pytest.FixtureRequest
) -> None:
    """Each error as PostgreSQL and psycopg raise it, through Django's connection."""

    def terminated() -> None:
        own = connection.cursor().connection.info.backend_pid
        with psycopg.connect(admin_conninfo(), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [own])
        Capability.objects.count()

    def cancelled() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = '50ms'")
            cursor.execute("SELECT pg_sleep(5)")

    def duplicate() -> None:
        Capability.objects.create(scope=refund.scope)

    lost = {"terminated": connection_lost(database_error(terminated))}
    lost["cancelled"] = connection_lost(database_error(cancelled))
    lost["duplicate"] = connection_lost(database_error(duplicate))
    request.getfixturevalue("unreachable_database")
    lost["refused"] = connection_lost(database_error(Capability.objects.count))
    assert lost == {"terminated": True, "cancelled": False, "duplicate": False, "refused": True}


@pytest.mark.django_db(transaction=True)
def test_a_task_that_finds_the_database_unreachable_logs_a_line_and_ends(
    unreachable_database: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Celery logged an error with two tracebacks for every task that ran while
    PostgreSQL was down or restarting (seen when `make run`'s was killed); nothing
    rests on a task's message, and its next run does what it did not."""
    assert sweep_overdue_attempts() is None
    told = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= WARNING]
    # psycopg's pool says why it could not connect, each time it tries.
    assert {name for name, *_ in told} == {"psycopg.pool", "ledger.celery"}
    assert [(level, said) for name, level, said in told if name == "ledger.celery"] == [
        (
            "WARNING",
            "task not done task=reconciliation.tasks.sweep_overdue_attempts database "
            "unreachable: couldn't get a connection after 2.00 sec",
        )
    ]


@pytest.mark.django_db(transaction=True)
def test_a_task_whose_statement_postgres_refuses_still_fails(refund: Capability) -> None:
    @app.task(name="tests.register_twice")
    def register_twice() -> None:
        Capability.objects.create(scope=refund.scope)

    with pytest.raises(IntegrityError):
        register_twice()


@pytest.mark.django_db(transaction=True)
def test_a_database_session_killed_mid_write_leaves_nothing_half_written(
    api: Api, refund: Capability
) -> None:
    """The server terminates the session while its evidence write is executing."""
    admin = psycopg.connect(admin_conninfo())

    def kill_when_blocked(pid: int) -> None:
        with psycopg.connect(admin_conninfo(), autocommit=True) as watcher:
            for _ in range(500):
                row = watcher.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
                ).fetchone()
                if row and row[0] == "Lock":
                    watcher.execute("SELECT pg_terminate_backend(%s)", [pid])
                    return
                time.sleep(0.01)

    writes_sent = []

    def kill_during_write(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "new_invocation AS" in sql:
            writes_sent.append(sql)
            # Hold the event table so the write stops mid-flight, then kill its session.
            admin.execute("LOCK TABLE ledger_event IN ACCESS EXCLUSIVE MODE")
            pid = context["connection"].connection.info.backend_pid
            threading.Thread(target=kill_when_blocked, args=(pid,)).start()
        return execute(sql, params, many, context)

    try:
        with connection.execute_wrapper(kill_during_write):
            status, body = api.intent(attempt_id="a1")
    finally:
        admin.rollback()
        admin.close()
    assert (status, body["error"]["type"]) == (503, "ledger_unavailable")
    # Sent once: what failed after it reached PostgreSQL is the runtime's to resend.
    assert len(writes_sent) == 1
    connection.close()
    assert (Invocation.objects.count(), Attempt.objects.count(), Event.objects.count()) == (
        0,
        0,
        0,
    )
    # The runtime resends the same request, as the error tells it to.
    status, body = api.intent(attempt_id="a1")
    assert (status, body["status"]) == (201, "in_flight")


def operator_client(**options: Any) -> Client:
    operator = User.objects.create_user("olga")
    operator.groups.add(Group.objects.get_or_create(name="operator")[0])
    client = Client(**options)
    client.force_login(operator)
    return client


@pytest.mark.django_db(transaction=True)
def test_the_console_says_the_database_is_unreachable_and_nothing_changed(
    refund: Capability, request: pytest.FixtureRequest
) -> None:
    client = operator_client()
    request.getfixturevalue("unreachable_database")
    for path in ("/", "/dashboard/", "/audit/"):
        response = client.get(path)
        assert response.status_code == 503, path
        assert "cannot be reached" in response.content.decode()
        assert "Nothing was changed" in response.content.decode()
        assert response["Retry-After"] == "30"


def test_a_console_bug_shows_the_ledgers_error_page_and_is_logged(
    refund: Capability, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(views, "queue_rows", broken)
    response = operator_client(raise_request_exception=False).get("/")
    assert response.status_code == 500
    assert "Something went wrong on the ledger's side" in response.content.decode()
    [logged] = [r for r in caplog.records if r.name == "django.request"]
    assert (logged.levelname, logged.getMessage()) == ("ERROR", "Internal Server Error: /")
    assert logged.exc_info is not None and "a bug" in str(logged.exc_info[1])


def test_a_ledger_bug_answers_the_runtime_a_typed_error_and_is_logged(
    api: Api, refund: Capability, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Never an HTML page: the runtime reads the same typed error as everywhere else."""
    assert api.intent(attempt_id="a1")[0] == 201

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(services, "record_outcome", broken)
    failing = Api(Client(raise_request_exception=False), api.token)
    status, body = failing.outcome("inv-1", "a1", kind="succeeded")
    assert status == 500
    assert body["error"]["type"] == "internal_error"
    assert "send the same request again" in body["error"]["message"]
    [logged] = [r for r in caplog.records if r.name == "django.request"]
    assert logged.levelname == "ERROR"
    assert logged.exc_info is not None and "a bug" in str(logged.exc_info[1])
    monkeypatch.undo()
    assert api.outcome("inv-1", "a1", kind="succeeded")[0] == 201


def test_a_wrong_url_or_host_is_a_typed_error_for_a_runtime_and_a_page_for_a_person(
    api: Api, refund: Capability
) -> None:
    assert api.get("/api/v1/intent") == (
        404,
        {"error": {"type": "not_found", "message": "The API has no such endpoint.",
                   "details": {"path": "/api/v1/intent"}}},
    )  # fmt: skip
    status, body = api.post("/api/v1/intents", intent_body(), HTTP_HOST="ledger.example")
    assert (status, body["error"]["type"]) == (400, "malformed_request")
    assert not Invocation.objects.exists()
    page = operator_client().get("/no-such-page/")
    assert page.status_code == 404
    assert "There is no page here" in page.content.decode()


def test_a_refused_request_is_answered_not_logged(
    refund: Capability, api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    """A 4xx is the client's: it has its typed error, the access log its status."""
    assert Client().get("/api/v1/invocations/inv-1").status_code == 401
    assert api.get("/api/v1/invocations/no-such")[0] == 404
    assert api.intent(invocation_id="inv-1", idempotency_key="k-1")[0] == 201
    assert api.intent(invocation_id="inv-1", idempotency_key="k-2")[0] == 409
    assert [r.getMessage() for r in caplog.records if r.name == "django.request"] == []


@pytest.mark.django_db(transaction=True)
def test_runtimes_do_not_notice_postgres_dropping_every_pooled_connection(
    api: Api, refund: Capability, web_processes: list[str]
) -> None:
    """As a PostgreSQL restart or failover does, between requests: every connection
    the running gunicorn processes hold in their pools dies. Each request is answered
    all the same, from a fresh connection, and recorded once."""
    headers = {**api.headers(), "Content-Type": "application/json"}

    def intent(url: str, n: int) -> int:
        body = intent_body(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        return httpx.post(f"{url}/api/v1/intents", json=body, headers=headers).status_code

    for n, url in enumerate(web_processes * 4):
        assert intent(url, n) == 201  # each pool now holds live connections
    own = connection.connection.info.backend_pid if connection.connection else 0
    with psycopg.connect(admin_conninfo(), autocommit=True) as admin:
        dropped = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), %s)",
            [own],
        ).fetchone()
    assert dropped is not None and dropped[0] >= len(web_processes)
    answers = [intent(url, 100 + n) for n, url in enumerate(web_processes * 4)]
    assert answers == [201] * len(answers)
    assert Invocation.objects.count() == 16
    assert Event.objects.count() == 32  # intent_recorded and attempt_admitted, once each


@pytest.mark.django_db(transaction=True)
def test_the_orm_is_not_lent_a_connection_postgres_dropped(refund: Capability) -> None:
    """The console's pages and the sweeper read through the ORM: after a restart their
    next query runs too, on a connection the pool lends in place of the dropped one."""
    assert Capability.objects.count() == 1
    dropped = connection.connection.info.backend_pid
    connection.close()  # back to the pool, where it sits idle
    with psycopg.connect(admin_conninfo(), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [dropped])
        admin.execute("SELECT pg_sleep(0.1)")  # its farewell reaches the socket
    assert Capability.objects.count() == 1
    assert connection.connection.info.backend_pid != dropped
