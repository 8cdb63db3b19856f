"""The hot-path benchmark: the API under gunicorn against raw psycopg on one database.

    uv run python manage.py bench  (make bench)

It creates a scratch database `<name>_bench` beside the configured one, migrates it,
serves the API from it with gunicorn (gthread), and in the same run measures:

- raw: single-row INSERT + COMMIT of an invocation-sized row with psycopg — the
  physical limit of a durable write on this machine;
- api: runtimes that record an intent with its first attempt, then the outcome,
  over keep-alive HTTP, at 1 and 8 concurrent clients (separate processes);
- floor: at 1 and 8 clients, GETs that write nothing (`/healthz`, and an unknown
  invocation answered 404 after token authentication): what a request costs this
  stack before the ledger does any work, the ceiling for any API write;
- raw, api and floor alternate in `--rounds` slices (5 by default), so that each
  ratio compares figures taken under the same drift of the machine's speed; during
  the 8-client slices, the CPU each process group spends, from /proc;
- enforced: the intent at 1 client under a capability whose declared rate limit the
  ledger enforces (a limit never reached), alternating with the plain intent; and at 8
  clients, where that capability's admissions take turns on its lock, the intents a
  second against the plain intent's, alternating likewise;
- batch: POST /api/v1/evidence with 1,000 intents per request, 1 and 2 clients,
  and the floor of its rows: the same rows copied by one SQL statement per 1,000;
- reconciliation: among 100,000 terminal invocations, 1,000 overdue ones are swept
  (time from deadline to flagged) and then probed against the stand-in payments
  service (settled per second);
- rate watch: after the batch, every event the API wrote sealed (events per second),
  then read by a rate watch from the first, against a limit the API does not reach
  (admissions read and judged per second).

It prints a table, then the figures as JSON on the last line. Not a test: nothing
here asserts a time.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
import json
import logging
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from operator import ge, le
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from psycopg import sql

RAW_TABLE = """
CREATE TABLE IF NOT EXISTS bench_raw (
    id bigserial PRIMARY KEY,
    invocation_id varchar(128) NOT NULL UNIQUE,
    task_id varchar(128) NOT NULL,
    idempotency_key varchar(256) NOT NULL,
    arguments jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""
RAW_INSERT = (
    "INSERT INTO bench_raw (invocation_id, task_id, idempotency_key, arguments) "
    "VALUES (%s, %s, %s, %s)"
)
BATCH_SIZE = 1000
FLOOR_REQUESTS = [
    ("django_healthz", "/healthz", 200),
    ("drf_authenticated_404", "/api/v1/invocations/none-{tag}", 404),
]
ARGUMENTS = {"order": "SO-1", "amount": "12.50", "currency": "EUR", "reason": "damaged"}


# Issue #2's bars: (name, figure, how the figure must compare with the bar, bar).
TARGETS = (
    ("intent p50 at 1 client within 6x the raw insert's", "intent_over_raw_p50", le, 6.0),
    ("API writes/s at 8 clients at least 20% of raw inserts/s", "writes_over_raw_8", ge, 0.2),
    ("batch items/s at least 5,000 (the better of 1 and 2 clients)", "batch_items", ge, 5000),
)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of the bars with this run's figure and whether the figure meets it."""
    ratios = results["ratios"]
    figures = {
        "intent_over_raw_p50": ratios["intent_p50_over_raw_p50_1_client"],
        "writes_over_raw_8": ratios["api_writes_per_second_over_raw_8_clients"],
        "batch_items": max(results[f"batch_{n}"]["items_per_second"] for n in (1, 2)),
    }
    return [
        {"target": name, "figure": figures[key], "bar": bar, "met": meets(figures[key], bar)}
        for name, key, meets, bar in TARGETS
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(latencies: list[float], elapsed: float, count: int) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
        "per_second": round(count / elapsed, 1),
    }


def items_rate(sent: list[int], elapsed: float, spent: dict[str, float]) -> dict[str, Any]:
    """Items a second, and the CPU each took (`cpu_spent`): at 2 clients both cores are
    busy, so that, not the wait for an answer, is what the rate is made of."""
    return {
        "items": sum(sent),
        "items_per_second": round(sum(sent) / elapsed, 1),
        "cpu_ms_per_item": cpu_per_operation(spent, sum(sent)),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Raw psycopg ----------------------------------------------------------------


def raw_worker(conninfo: str, seconds: float, tag: str, queue: Any) -> None:
    latencies = []
    with psycopg.connect(conninfo) as conn:
        deadline = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < deadline:
            n += 1
            key = f"{tag}-{n}"
            started = time.perf_counter()
            conn.execute(RAW_INSERT, (key, "task", key, json.dumps(ARGUMENTS)))
            conn.commit()
            latencies.append(time.perf_counter() - started)
    queue.put(latencies)


# API ------------------------------------------------------------------------


class Runtime:
    """One keep-alive HTTP connection speaking the runtime protocol."""

    def __init__(self, port: int, token: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def get(self, path: str) -> tuple[int, bytes]:
        self.conn.request("GET", path, headers=self.headers)
        response = self.conn.getresponse()
        return response.status, response.read()

    def post(self, path: str, body: Any) -> tuple[int, bytes]:
        self.conn.request("POST", path, json.dumps(body), self.headers)
        response = self.conn.getresponse()
        return response.status, response.read()

    def invoke(self, invocation_id: str, capability: str = "refund.create") -> tuple[float, float]:
        started = time.perf_counter()
        status, body = self.post(
            "/api/v1/intents",
            {
                "invocation_id": invocation_id,
                "task_id": "bench-task",
                "capability": capability,
                "arguments": ARGUMENTS,
                "idempotency_key": invocation_id,
                "attempt_id": "a1",
            },
        )
        intent_done = time.perf_counter()
        if status != 201:
            raise RuntimeError(f"intent answered {status}: {body[:300]!r}")
        status, body = self.post(
            f"/api/v1/invocations/{invocation_id}/attempts/a1/outcome",
            {"kind": "succeeded", "business_reference": f"RF-{invocation_id}"},
        )
        if status != 201:
            raise RuntimeError(f"outcome answered {status}: {body[:300]!r}")
        return intent_done - started, time.perf_counter() - intent_done


def api_worker(
    port: int, token: str, seconds: float, tag: str, queue: Any, capability: str = "refund.create"
) -> None:
    runtime = Runtime(port, token)
    intents, outcomes = [], []
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        n += 1
        intent, outcome = runtime.invoke(f"{tag}-{n}", capability)
        intents.append(intent)
        outcomes.append(outcome)
    queue.put((intents, outcomes))


# A capability whose declared rate limit the ledger enforces, never reached here: what
# each admission of such a capability costs (ledger.rate_enforcement).
ENFORCED = "refund.enforced"
ENFORCED_LIMIT = {"count": 1_000_000_000, "window": "1h"}


def enforced_api_worker(port: int, token: str, seconds: float, tag: str, queue: Any) -> None:
    api_worker(port, token, seconds, f"enforced-{tag}", queue, capability=ENFORCED)


def floor_worker(port: int, token: str, seconds: float, tag: str, queue: Any) -> None:
    """GETs that write nothing, for the floor of a request on this stack: `/healthz`
    (gunicorn and Django with its middleware) and an unknown invocation (the same,
    plus DRF, token authentication, the throttle and a typed 404)."""
    runtime = Runtime(port, token)
    latencies: dict[str, list[float]] = {}
    for name, path, expected in FLOOR_REQUESTS:
        path = path.format(tag=tag)
        latencies[name] = []
        deadline = time.perf_counter() + seconds / len(FLOOR_REQUESTS)
        while (started := time.perf_counter()) < deadline:
            status, body = runtime.get(path)
            latencies[name].append(time.perf_counter() - started)
            if status != expected:
                raise RuntimeError(f"{path} answered {status}: {body[:300]!r}")
    queue.put(latencies)


def batch_worker(port: int, token: str, seconds: float, tag: str, queue: Any) -> None:
    """POSTs 1,000-intent batches to /api/v1/evidence until the time is up."""
    runtime = Runtime(port, token)
    items_sent = 0
    deadline = time.perf_counter() + seconds
    b = 0
    while time.perf_counter() < deadline:
        b += 1
        items = [
            {
                "type": "intent",
                "invocation_id": f"batch-{tag}-{b}-{i}",
                "task_id": "bench-task",
                "capability": "refund.create",
                "arguments": ARGUMENTS,
                "idempotency_key": f"batch-{tag}-{b}-{i}",
                "attempt_id": "a1",
            }
            for i in range(BATCH_SIZE)
        ]
        status, body = runtime.post("/api/v1/evidence", items)
        if status != 207:
            raise RuntimeError(f"batch answered {status}: {body[:300]!r}")
        items_sent += len(items)
    queue.put(items_sent)


def batch_rows_sql() -> str:
    """One statement writing what a batch of new intents writes, without the ledger.

    For each of `%(n)s` new invocation ids it copies a template invocation written by
    the batch endpoint, with its attempt and events, into the real tables: the same
    rows, indexes, foreign-key checks and commit, and no Python at all. The floor
    of the batch endpoint's items per second on this machine.
    """
    from ledger.store import ATTEMPT_FIELDS, EVENT_FIELDS, INVOCATION_FIELDS

    fresh = {"invocation_id": "%(prefix)s || g", "idempotency_key": "%(prefix)s || g"}
    invocation_columns = [column for column, _ in INVOCATION_FIELDS]
    copied = ", ".join(fresh.get(column, f"t.{column}") for column in invocation_columns)
    attempt_columns = ", ".join(column for column, _ in ATTEMPT_FIELDS)
    event_columns = ", ".join(column for column, _ in EVENT_FIELDS)
    return f"""
WITH t AS (SELECT * FROM ledger_invocation WHERE invocation_id = %(template)s),
new_invocation AS (
  INSERT INTO ledger_invocation ({", ".join(invocation_columns)})
  SELECT {copied} FROM t CROSS JOIN generate_series(1, %(n)s) AS g
  RETURNING id, created_at),
new_attempt AS (
  INSERT INTO ledger_attempt (invocation_id, {attempt_columns})
  SELECT n.id, {", ".join(f"a.{c}" for c, _ in ATTEMPT_FIELDS)}
  FROM new_invocation n CROSS JOIN ledger_attempt a JOIN t ON a.invocation_id = t.id
  RETURNING 1),
new_event AS (
  INSERT INTO ledger_event (invocation_id, invocation_created_at, {event_columns})
  SELECT n.id, n.created_at, {", ".join(f"e.{c}" for c, _ in EVENT_FIELDS)}
  FROM new_invocation n CROSS JOIN ledger_event e JOIN t ON e.invocation_id = t.id
  RETURNING 1)
SELECT (SELECT count(*) FROM new_invocation), (SELECT count(*) FROM new_attempt),
       (SELECT count(*) FROM new_event)
"""


def batch_rows_worker(
    conninfo: str, statement: str, template: str, seconds: float, tag: str, queue: Any
) -> None:
    written = 0
    with psycopg.connect(conninfo, autocommit=True) as conn:
        deadline = time.perf_counter() + seconds
        b = 0
        while time.perf_counter() < deadline:
            b += 1
            params = {"template": template, "prefix": f"rows-{tag}-{b}-", "n": BATCH_SIZE}
            row = conn.execute(statement, params).fetchone()
            invocations, attempts, events = row if row else (0, 0, 0)
            if (invocations, attempts, events) != (BATCH_SIZE, BATCH_SIZE, 2 * BATCH_SIZE):
                raise RuntimeError(f"the rows statement wrote {invocations, attempts, events}")
            written += invocations
    queue.put(written)


# CPU ----------------------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# The web pid given to `cpu_seconds` when no web server runs: no process has it.
NO_WEB = -1
# Elsewhere than on Linux the benchmark runs without its CPU split.
HAS_PROC = Path("/proc/stat").exists()


def cpu_seconds(web_pid: int) -> dict[str, float]:
    """CPU used so far, from /proc: by gunicorn, PostgreSQL, this process's client
    processes and the whole machine.

    A process's own time plus the time of the children it has reaped: the postmaster
    reaps the backends of the raw clients' connections and this process its clients,
    so nothing spent between two samples is lost when a process exits. PostgreSQL
    counts only if it runs on this machine.
    """
    used = {"web": 0.0, "postgres": 0.0, "clients": 0.0}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:  # it exited meanwhile
            continue
        pid = int(entry.name)
        command = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        parent = int(fields[1])
        ticks = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        if pid == web_pid or parent == web_pid:
            used["web"] += ticks / CLOCK_TICKS
        elif command == "postgres":
            used["postgres"] += ticks / CLOCK_TICKS
        elif pid == os.getpid():
            used["clients"] += ticks / CLOCK_TICKS
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9]
        )
    used["machine"] = (user + nice + system + irq + softirq + steal) / CLOCK_TICKS
    return used


@contextlib.contextmanager
def cpu_spent(web_pid: int, into: dict[str, float]) -> Iterator[None]:
    """Adds to `into` the CPU spent in the block, by the groups of `cpu_seconds`."""
    before = cpu_seconds(web_pid)
    yield
    after = cpu_seconds(web_pid)
    for group, seconds in after.items():
        into[group] = into.get(group, 0.0) + seconds - before[group]


def cpu_per_operation(spent: dict[str, float], operations: int) -> dict[str, float]:
    """Milliseconds of CPU per operation; `other` is the machine's rest (kernel, idle
    processes), never below zero."""
    per = {group: 1000 * seconds / operations for group, seconds in spent.items()}
    accounted = per["web"] + per["postgres"] + per["clients"]
    per["other"] = max(per["machine"] - accounted, 0.0)
    return {group: round(ms, 3) for group, ms in per.items()}


def run_clients(
    target: Callable[..., None], clients: int, args: tuple[Any, ...], seconds: float
) -> tuple[list[Any], float]:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    run_tag = uuid.uuid4().hex[:8]
    processes = [
        ctx.Process(target=target, args=(*args, seconds, f"{run_tag}-{i}", queue))
        for i in range(clients)
    ]
    started = time.perf_counter()
    for process in processes:
        process.start()
    results = [queue.get(timeout=seconds + 120) for _ in processes]
    elapsed = time.perf_counter() - started
    for process in processes:
        process.join()
        if process.exitcode:
            raise RuntimeError(f"a client exited with {process.exitcode}")
    return results, elapsed


class Command(BaseCommand):
    help = "Benchmark the runtime API against raw PostgreSQL inserts (see module docstring)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
        parser.add_argument(
            "--rounds",
            type=int,
            default=5,
            help="raw, api and floor alternate this many times, each for seconds/rounds",
        )
        parser.add_argument("--web-workers", type=int, default=2)
        parser.add_argument("--web-threads", type=int, default=8)

    def handle(self, *args: Any, **options: Any) -> None:
        seconds = options["seconds"]
        database = settings.DATABASES["default"]
        bench_db = f"{database['NAME']}_bench"
        admin = psycopg.conninfo.make_conninfo(
            host=str(database["HOST"]) or None,
            port=str(database["PORT"]) or None,
            user=str(database["USER"]) or None,
            password=str(database["PASSWORD"]) or None,
            dbname="postgres",
        )
        bench_conninfo = psycopg.conninfo.make_conninfo(admin, dbname=bench_db)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(bench_db))
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(bench_db)))
        env = {**os.environ, "DATABASE_URL": self.url(database, bench_db)}
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], env=env, check=True)
        # As `make run` does; without it, each gunicorn worker warns that it is missing.
        subprocess.run(
            [sys.executable, "manage.py", "collectstatic", "--no-input", "-v", "0"],
            env=env,
            check=True,
        )
        token = (
            subprocess.run(
                [sys.executable, "manage.py", "create_runtime", "bench"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        with psycopg.connect(bench_conninfo, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO ledger_capability (scope, enabled, readonly, idempotent, "
                "idempotency_verified, risk_level, subject_required, audit_sensitive, "
                "redact_paths, probe, declaration, version, created_at, updated_at) VALUES "
                "('refund.create', true, false, false, false, 'high', false, false, '{}', '{}', "
                "'{}', 0, now(), now())"
            )
            conn.execute(
                "INSERT INTO ledger_capability (scope, enabled, readonly, idempotent, "
                "idempotency_verified, risk_level, subject_required, audit_sensitive, "
                "redact_paths, probe, declaration, version, created_at, updated_at, "
                "rate_limit_enforced) VALUES (%s, true, false, false, false, 'high', false, "
                "false, '{}', '{}', %s, 0, now(), now(), true)",
                [ENFORCED, json.dumps({"execution": {"rate_limit": ENFORCED_LIMIT}})],
            )
            conn.execute(RAW_TABLE)
        results: dict[str, Any] = {"machine": {"cores": os.cpu_count()}}
        with self.gunicorn(env, options["web_workers"], options["web_threads"]) as (port, pid):
            rounds = options["rounds"]
            results.update(self.interleaved(port, pid, token, bench_conninfo, seconds, rounds))
            results["api_1_enforced"] = self.enforced(port, token, seconds, rounds)
            for clients in (1, 2):
                spent: dict[str, float] = {}
                with cpu_spent(pid, spent):
                    # A batch finishes after the deadline: count the time it really took.
                    sent, elapsed = run_clients(batch_worker, clients, (port, token), seconds)
                results[f"batch_{clients}"] = items_rate(sent, elapsed, spent)
        results["rate_watch"] = self.rate_watch(bench_db)
        results["reference_watch"] = self.reference_watch()
        with psycopg.connect(bench_conninfo) as conn:
            (template,) = conn.execute(
                "SELECT invocation_id FROM ledger_invocation WHERE invocation_id LIKE 'batch-%%' "
                "LIMIT 1"
            ).fetchone() or (None,)
        if template is None:
            raise RuntimeError("the batch wrote no invocation to copy for its rows' floor")
        for clients in (1, 2):
            args = (bench_conninfo, batch_rows_sql(), template)
            spent = {}
            with cpu_spent(NO_WEB, spent):
                sent, elapsed = run_clients(batch_rows_worker, clients, args, seconds)
            results[f"batch_rows_floor_{clients}"] = items_rate(sent, elapsed, spent)
        results["reconciliation"] = self.reconciliation(bench_conninfo, bench_db)
        raw1, raw8 = results["raw_1"], results["raw_8"]
        results["ratios"] = {
            "intent_p50_over_raw_p50_1_client": round(
                results["api_1"]["intent"]["p50_ms"] / raw1["p50_ms"], 2
            ),
            "api_writes_per_second_over_raw_8_clients": round(
                results["api_8"]["writes_per_second"] / raw8["per_second"], 3
            ),
            "drf_floor_p50_over_raw_p50_1_client": round(
                results["floor_1"]["drf_authenticated_404"]["p50_ms"] / raw1["p50_ms"], 2
            ),
            "drf_floor_per_second_over_raw_8_clients": round(
                results["floor_8"]["drf_authenticated_404"]["per_second"] / raw8["per_second"], 3
            ),
            # What a write costs against a request that does nothing (see README).
            "api_writes_per_second_over_drf_floor_8_clients": round(
                results["api_8"]["writes_per_second"]
                / results["floor_8"]["drf_authenticated_404"]["per_second"],
                3,
            ),
            "batch_items_per_second_over_raw_8_clients": round(
                results["batch_1"]["items_per_second"] / raw8["per_second"], 3
            ),
            "batch_items_per_second_over_its_rows_floor_1_client": round(
                results["batch_1"]["items_per_second"]
                / results["batch_rows_floor_1"]["items_per_second"],
                3,
            ),
        }
        results["targets"] = targets(results)
        self.report(results)

    def reconciliation(self, conninfo: str, bench_db: str) -> dict[str, Any]:
        """100,000 terminal invocations and 1,000 overdue ones: the sweep, then probes."""
        from concurrent.futures import ThreadPoolExecutor

        from django.db import connection, connections

        from ledger.models import Capability, Event
        from reconciliation import sweeper
        from reconciliation.standin import StandInService
        from reconciliation.tasks import reconcile_invocation

        terminal, overdue = 100_000, 1_000
        columns = (
            "invocation_id, runtime_id, task_id, capability_id, capability_scope, subject, "
            "idempotency_key, arguments_digest, traceparent, created_at, hint_readonly, "
            "hint_idempotency_verified, max_attempts, timeout_ms, grace_ms, risk_level, "
            "status, failure_class, cause, resolution, flags, attempt_count, "
            "in_flight_attempt, deadline_at, event_count, head_hash, updated_at, "
            "lease_owner, probe_tries"
        )
        rows = (
            "SELECT '{prefix}' || n, r.id, 't', c.id, 'refund.create', '', '{prefix}' || n, "
            "'sha256:x', '', now(), false, false, 5, 30000, 60000, 'high', {status}, '', '', "
            "'', '{{}}', 1, {attempt}, {deadline}, 1, repeat('0', 64), now(), '', 0 "
            "FROM generate_series(1, %s) n, ledger_runtime r, ledger_capability c "
            "WHERE r.name = 'bench' AND c.scope = 'refund.create'"
        )
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(
                f"INSERT INTO ledger_invocation ({columns}) "
                + rows.format(prefix="done-", status="'succeeded'", attempt="''", deadline="NULL"),
                [terminal],
            )
            conn.execute(
                f"INSERT INTO ledger_invocation ({columns}) "
                + rows.format(
                    prefix="late-", status="'in_flight'", attempt="'a1'", deadline="now()"
                ),
                [overdue],
            )
            # Each row's last event, recording the row's state: a write reads it and
            # refuses a row that disagrees. (Its hash is not a real one; nothing here
            # verifies chains.)
            conn.execute(
                "INSERT INTO ledger_event (invocation_id, invocation_created_at, seq, kind, "
                "actor, data, created_at, prev_hash, hash) "
                "SELECT i.id, i.created_at, 1, 'attempt_admitted', 'bench', "
                "jsonb_build_object('state', "
                "jsonb_build_object('status', i.status, 'failure_class', null, 'cause', null, "
                "'resolution', null, 'flags', '[]'::jsonb, 'attempt_count', i.attempt_count, "
                "'in_flight_attempt', nullif(i.in_flight_attempt, ''))), now(), "
                "repeat('0', 64), i.head_hash FROM ledger_invocation i "
                "WHERE left(i.invocation_id, 5) IN ('done-', 'late-')"
            )
            conn.execute("ANALYZE ledger_invocation")
            conn.execute("ANALYZE ledger_event")
            # Due now, not when the rows were made: the lag below is the sweep's alone.
            conn.execute(
                "UPDATE ledger_invocation SET deadline_at = now() "
                "WHERE left(invocation_id, 5) = 'late-'"
            )
        connections.close_all()
        connection.settings_dict["NAME"] = bench_db
        started = time.perf_counter()
        flagged = sweeper.sweep()
        sweep_seconds = time.perf_counter() - started
        lags = [
            (created - dt.datetime.fromisoformat(data["deadline_at"])).total_seconds() * 1000
            for created, data in Event.objects.filter(
                kind="evidence_missing", invocation__invocation_id__startswith="late-"
            ).values_list("created_at", "data")
        ]
        with tempfile.TemporaryDirectory() as folder:
            standin = StandInService(Path(folder) / "standin.sqlite3").start()
            try:
                for n in range(1, overdue + 1, 2):
                    standin.refunds.create(f"late-{n}", "SO", 10)
                Capability.objects.filter(scope="refund.create").update(
                    probe=standin.probe_config()
                )
                ids = sweeper.due_for_probe(batch=overdue)
                threads = 4
                # A worker logs each probe it runs: a thousand such lines would bury
                # the report, and writing them would be timed with the probes.
                logging.getLogger("reconciliation.tasks").setLevel(logging.WARNING)

                def settle(invocation_id: str) -> str:
                    try:
                        return str(reconcile_invocation.run(invocation_id))
                    finally:
                        connection.close()

                started = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    outcomes = list(pool.map(settle, ids))
                probe_seconds = time.perf_counter() - started
            finally:
                standin.stop()
        settled = outcomes.count("recorded")
        return {
            "terminal": terminal,
            "overdue": overdue,
            "flagged": flagged,
            "sweep_seconds": round(sweep_seconds, 3),
            "flagged_per_second": round(flagged / sweep_seconds, 1),
            "deadline_to_flagged_p50_ms": round(statistics.median(lags), 1),
            "deadline_to_flagged_max_ms": round(max(lags), 1),
            "settled": settled,
            "probe_seconds": round(probe_seconds, 3),
            "settled_per_second": round(settled / probe_seconds, 1),
            "probe_threads": threads,
        }

    @staticmethod
    def rate_watch(bench_db: str) -> dict[str, Any]:
        """Every event the API wrote in this run sealed, then read by a rate watch that
        started before the first: what a watch costs per admission. The limit, a million
        a second, is one the API does not reach, so that the figure is the reading and
        judging alone (flagging is the sweep's kind of write, measured apart): at 10,000,
        a batch from 2 clients at 10,275 items a second went past it, and 77,000
        breaches flagged made the figure a tenth of its worth."""
        from django.db import connection, connections

        from ledger import rate_limits
        from ledger.integrity import seal_events
        from ledger.models import Capability, RateWatch

        connections.close_all()
        connection.settings_dict["NAME"] = bench_db
        started = time.perf_counter()
        sealed = 0
        while (seal := seal_events()) is not None:
            sealed += seal.event_count
        seal_seconds = time.perf_counter() - started
        # A scratch database: the declaration is set by hand, not through the registry,
        # and the watch by hand, as if it had been declared before the first event.
        declared = {"count": 1_000_000, "window": "1s"}
        Capability.objects.filter(scope="refund.create").update(
            declaration={"execution": {"rate_limit": declared}}
        )
        RateWatch.objects.create(
            scope="refund.create",
            rate_limit=declared,
            since=dt.datetime(2000, 1, 1, tzinfo=dt.UTC),
            through_sequence=0,
        )
        runs: list[rate_limits.Watched] = []
        started = time.perf_counter()
        while not runs or not runs[-1].caught_up:
            runs.append(rate_limits.watch_rate_limits())
        watch_seconds = time.perf_counter() - started
        admissions = sum(run.admissions for run in runs)
        return {
            "sealed_events": sealed,
            "seal_seconds": round(seal_seconds, 3),
            "sealed_per_second": round(sealed / seal_seconds, 1),
            "admissions": admissions,
            "breaches": sum(run.breaches for run in runs),
            "runs": len(runs),
            "watch_seconds": round(watch_seconds, 3),
            "admissions_per_second": round(admissions / watch_seconds, 1),
        }

    @staticmethod
    def reference_watch() -> dict[str, Any]:
        """The reference watch over every event the API wrote, sealed by rate_watch:
        what a watch costs that reads only the few events naming a shared reference."""
        from ledger import shared_references
        from ledger.models import SealedEvent

        sealed = SealedEvent.objects.count()
        runs: list[shared_references.Watched] = []
        started = time.perf_counter()
        while not runs or not runs[-1].caught_up:
            runs.append(shared_references.watch_shared_references())
        watch_seconds = time.perf_counter() - started
        return {
            "sealed_events": sealed,
            "shared": sum(run.shared for run in runs),
            "flagged": sum(len(run.flagged) for run in runs),
            "runs": len(runs),
            "watch_seconds": round(watch_seconds, 3),
        }

    @staticmethod
    def enforced(port: int, token: str, seconds: float, rounds: int) -> dict[str, Any]:
        """The intent under a capability whose rate limit is enforced, against the same
        intent under refund.create, in `rounds` alternating slices (each of
        seconds/rounds/2): at 1 client, and at 8, where the enforced capability's
        admissions take turns on its lock while the plain ones do not."""
        share = seconds / rounds / 2
        plain: list[float] = []
        enforced: list[float] = []
        per_round = []
        for _ in range(rounds):
            for worker, into in ((api_worker, plain), (enforced_api_worker, enforced)):
                got, _ = run_clients(worker, 1, (port, token), share)
                into += [x for intents, _ in got for x in intents]
            per_round.append(round(statistics.median(enforced) / statistics.median(plain), 2))
        at_8: dict[str, list[float]] = {"plain": [], "enforced": []}
        spent = {"plain": 0.0, "enforced": 0.0}
        for _ in range(rounds):
            for name, worker in (("plain", api_worker), ("enforced", enforced_api_worker)):
                got, elapsed = run_clients(worker, 8, (port, token), share)
                at_8[name] += [x for intents, _ in got for x in intents]
                spent[name] += elapsed
        plain_8, enforced_8 = (
            summary(at_8[name], spent[name], len(at_8[name])) for name in ("plain", "enforced")
        )
        return {
            "intent": summary(enforced, seconds / 2, len(enforced)),
            "plain_intent_p50_ms": round(statistics.median(plain) * 1000, 3),
            "over_plain_p50": round(statistics.median(enforced) / statistics.median(plain), 2),
            "over_plain_p50_round_by_round": per_round,
            "intent_8": enforced_8,
            "plain_intent_8": plain_8,
            "over_plain_per_second_8": round(enforced_8["per_second"] / plain_8["per_second"], 2),
        }

    @staticmethod
    def interleaved(
        port: int, web_pid: int, token: str, conninfo: str, seconds: float, rounds: int
    ) -> dict[str, Any]:
        """raw, api and floor at 1 and 8 clients, in `rounds` alternating slices.

        The machine's speed drifts: on the 2-core machines it differed by up to a
        factor of 2 between runs of the same code. A ratio of two figures measured
        minutes apart measures that drift too. Alternating short slices gives each
        figure the same mix of fast and slow moments; the per-round ratios show how
        much they still move.

        At 8 clients it also adds up the CPU each kind of request costs, by process.
        """
        latencies: dict[str, list[float]] = {}
        # CPU spent at 8 clients, by group, and the operations it was spent on.
        cpu: dict[str, dict[str, float]] = {"raw": {}, "api": {}, "floor": {}}
        done = {"raw": 0, "api": 0, "floor": 0}
        elapsed: dict[str, float] = {}
        per_round: dict[str, list[float]] = {"intent_over_raw_p50": [], "writes_over_raw_8": []}

        def add(name: str, values: list[float], seconds_taken: float) -> None:
            latencies.setdefault(name, []).extend(values)
            elapsed[name] = elapsed.get(name, 0.0) + seconds_taken

        def spent(kind: str, clients: int) -> contextlib.AbstractContextManager[None]:
            # Only the 8-client slices keep both cores busy.
            if clients == 8 and HAS_PROC:
                return cpu_spent(web_pid, cpu[kind])
            return contextlib.nullcontext()

        share = seconds / rounds
        for _ in range(rounds):
            for clients in (1, 8):
                with spent("raw", clients):
                    raw, raw_took = run_clients(raw_worker, clients, (conninfo,), share)
                raw_latencies = [x for chunk in raw for x in chunk]
                add(f"raw_{clients}", raw_latencies, raw_took)
                with spent("api", clients):
                    api, took = run_clients(api_worker, clients, (port, token), share)
                intents = [x for chunk, _ in api for x in chunk]
                add(f"api_{clients}.intent", intents, took)
                add(f"api_{clients}.outcome", [x for _, chunk in api for x in chunk], took)
                if clients == 1:
                    ratio = statistics.median(intents) / statistics.median(raw_latencies)
                    per_round["intent_over_raw_p50"].append(round(ratio, 2))
                else:
                    # Each intent has its outcome: two writes.
                    ratio = (2 * len(intents) / took) / (len(raw_latencies) / raw_took)
                    per_round["writes_over_raw_8"].append(round(ratio, 3))
                    done["raw"] += len(raw_latencies)
                    done["api"] += 2 * len(intents)
                with spent("floor", clients):
                    floor, took = run_clients(floor_worker, clients, (port, token), share)
                if clients == 8:
                    done["floor"] += sum(len(times) for chunk in floor for times in chunk.values())
                for name, _, _ in FLOOR_REQUESTS:
                    # Each client spends an equal share of the slice on each kind of request.
                    add(
                        f"floor_{clients}.{name}",
                        [x for chunk in floor for x in chunk[name]],
                        took / len(FLOOR_REQUESTS),
                    )
        results: dict[str, Any] = {
            "per_round_ratios": per_round,
            "cpu_ms_per_operation_8_clients": {
                kind: cpu_per_operation(cpu[kind], done[kind]) for kind in cpu if cpu[kind]
            },
        }
        for name, values in latencies.items():
            group, _, kind = name.partition(".")
            figures = summary(values, elapsed[name], len(values))
            if kind:
                results.setdefault(group, {})[kind] = figures
            else:
                results[group] = figures
        for clients in (1, 8):
            api = results[f"api_{clients}"]
            writes = api["intent"]["per_second"] + api["outcome"]["per_second"]
            api["writes_per_second"] = round(writes, 1)
        return results

    @staticmethod
    def url(database: dict[str, Any], name: str) -> str:
        user = database["USER"] or "postgres"
        password = f":{database['PASSWORD']}" if database["PASSWORD"] else ""
        host = database["HOST"] or ""
        if host.startswith("/"):
            return f"postgresql://{user}{password}@/{name}?host={host}"
        port = f":{database['PORT']}" if database["PORT"] else ""
        return f"postgresql://{user}{password}@{host}{port}/{name}"

    @contextlib.contextmanager
    def gunicorn(
        self, env: dict[str, str], workers: int, threads: int
    ) -> Iterator[tuple[int, int]]:
        """Serves the bench database; yields the port and the master's pid."""
        port = free_port()
        server = subprocess.Popen(
            [
                sys.executable, "-m", "gunicorn", "ledger.wsgi", "--bind", f"127.0.0.1:{port}",
                "--worker-class", "gthread", "--workers", str(workers),
                "--threads", str(threads), "--log-level", "warning",
                # Nothing controls it, and gunicorn's default socket is the user's one.
                "--no-control-socket",
            ],
            # ERROR: the floor's 404s would each log a warning; nothing measured here logs more.
            env={**env, "LOG_LEVEL": "ERROR", "LEDGER_THROTTLE_RATE": "100000000/min"},
        )  # fmt: skip
        try:
            for _ in range(100):
                with contextlib.suppress(OSError):
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                    conn.request("GET", "/healthz")
                    if conn.getresponse().status == 200:
                        break
                time.sleep(0.2)
            else:
                raise RuntimeError("gunicorn did not come up")
            # Warm every worker's connection pool and imports before measuring.
            run_clients(api_worker, 8, (port, self.token_for_warmup(env)), 2.0)
            yield port, server.pid
        finally:
            server.terminate()
            server.wait(timeout=30)

    @staticmethod
    def token_for_warmup(env: dict[str, str]) -> str:
        return (
            subprocess.run(
                [sys.executable, "manage.py", "create_runtime", f"warmup-{uuid.uuid4().hex[:6]}"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )

    def report(self, results: dict[str, Any]) -> None:
        out = self.stdout.write
        out("")
        out(f"{'measurement':<34}{'p50 ms':>10}{'p99 ms':>10}{'per second':>14}")
        for clients in (1, 8):
            raw = results[f"raw_{clients}"]
            out(
                f"{f'raw INSERT+COMMIT, {clients} client(s)':<34}"
                f"{raw['p50_ms']:>10}{raw['p99_ms']:>10}{raw['per_second']:>14}"
            )
            api = results[f"api_{clients}"]
            for kind in ("intent", "outcome"):
                row = api[kind]
                out(
                    f"{f'api {kind}, {clients} client(s)':<34}"
                    f"{row['p50_ms']:>10}{row['p99_ms']:>10}{row['per_second']:>14}"
                )
            out(f"{f'api writes, {clients} client(s)':<34}{'':>20}{api['writes_per_second']:>14}")
            for name, row in results[f"floor_{clients}"].items():
                out(
                    f"{f'floor {name}, {clients} cl.':<34}"
                    f"{row['p50_ms']:>10}{row['p99_ms']:>10}{row['per_second']:>14}"
                )
        for clients in (1, 2):
            out(
                f"{f'batch rows alone (SQL), {clients} cl.':<34}{'':>20}"
                f"{results[f'batch_rows_floor_{clients}']['items_per_second']:>14}"
            )
        for clients in (1, 2):
            out(
                f"{f'batch items, {clients} client(s)':<34}{'':>20}"
                f"{results[f'batch_{clients}']['items_per_second']:>14}"
            )
        enforced = results["api_1_enforced"]
        row = enforced["intent"]
        out(
            f"{'api intent, rate limit enforced, 1 cl.':<34}"
            f"{row['p50_ms']:>10}{row['p99_ms']:>10}{row['per_second']:>14}"
        )
        for name, value in results["ratios"].items():
            out(f"ratio {name}: {value}")
        row = enforced["intent_8"]
        out(
            f"{'api intent, rate limit enforced, 8 cl.':<34}"
            f"{row['p50_ms']:>10}{row['p99_ms']:>10}{row['per_second']:>14}"
        )
        row = enforced["plain_intent_8"]
        out(
            f"{'api intent, alongside it, 8 cl.':<34}"
            f"{row['p50_ms']:>10}{row['p99_ms']:>10}{row['per_second']:>14}"
        )
        out(
            f"ratio enforced_intent_p50_over_intent_p50_1_client: {enforced['over_plain_p50']} "
            f"(round by round: {', '.join(map(str, enforced['over_plain_p50_round_by_round']))}; "
            f"the intent alongside it {enforced['plain_intent_p50_ms']} ms)"
        )
        out(
            "ratio enforced_intents_per_second_over_intents_per_second_8_clients: "
            f"{enforced['over_plain_per_second_8']}"
        )
        for name, values in results["per_round_ratios"].items():
            out(f"ratio {name}, round by round: {', '.join(map(str, values))}")
        names = {"raw": "raw insert", "api": "API write", "floor": "floor request"}
        for kind, per in results["cpu_ms_per_operation_8_clients"].items():
            split = ", ".join(
                f"{group} {per[group]}" for group in ("web", "postgres", "clients", "other")
            )
            out(f"CPU ms per {names[kind]} at 8 clients: {per['machine']} ({split})")
        for name, result in (
            ("batch item", "batch_2"),
            ("item of the rows alone", "batch_rows_floor_2"),
        ):
            per = results[result]["cpu_ms_per_item"]
            split = ", ".join(
                f"{group} {per[group]}" for group in ("web", "postgres", "clients", "other")
            )
            out(f"CPU ms per {name} at 2 clients: {per['machine']} ({split})")
        for target in results["targets"]:
            verdict = "met" if target["met"] else "NOT met"
            out(f"target {target['target']}: {target['figure']} -> {verdict}")
        rec = results["reconciliation"]
        out(
            f"sweep: {rec['overdue']} overdue among {rec['terminal']} terminal flagged in "
            f"{rec['sweep_seconds']} s ({rec['flagged_per_second']}/s); deadline to flagged "
            f"p50 {rec['deadline_to_flagged_p50_ms']} ms, "
            f"max {rec['deadline_to_flagged_max_ms']} ms"
        )
        out(
            f"probes: {rec['settled']} settled against the stand-in in {rec['probe_seconds']} s "
            f"({rec['settled_per_second']}/s, {rec['probe_threads']} threads)"
        )
        watch = results["rate_watch"]
        out(
            f"rate watch: {watch['admissions']} sealed admissions read and judged in "
            f"{watch['watch_seconds']} s ({watch['admissions_per_second']}/s, {watch['runs']} "
            f"runs); sealing the API's {watch['sealed_events']} events took "
            f"{watch['seal_seconds']} s ({watch['sealed_per_second']}/s)"
            + (
                f"; {watch['breaches']} breaches flagged, so the figure counts flagging too"
                if watch["breaches"]
                else ""
            )
        )
        references = results["reference_watch"]
        out(
            f"reference watch: {references['sealed_events']} sealed events read in "
            f"{references['watch_seconds']} s ({references['runs']} runs), "
            f"{references['shared']} naming a shared reference, {references['flagged']} "
            "earlier invocations flagged"
        )
        out(json.dumps(results, sort_keys=True))
