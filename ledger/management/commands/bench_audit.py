"""The audit benchmark: 1,000,000 invocations written with COPY, then searched,
exported and verified.

    uv run python manage.py bench_audit            (part of `make bench`)

It builds a scratch database `<name>_bench_audit`, COPYs one million invocations
(two runtimes, twenty capabilities, a year of timestamps) each with its first event,
hash-chained (one in ten naming a business reference; one in a thousand olga's, one in
a hundred pat's), and reports: audit search p50/p95 for typical filters (first page of
the keyset), export rows per second and the exporting process's peak RSS for 200,000
events, `verify_ledger` events per second, a slice of the background verification, and
the console's pages (the action log also with a re-run of 1,000 escalations' probes on
top, and a search's evidence bundle). Last line: JSON. Not a test.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from psycopg import sql

from ledger import chain

COLUMNS = (
    "invocation_id", "runtime_id", "task_id", "capability_scope", "subject",
    "idempotency_key", "arguments_digest", "traceparent", "created_at", "hint_readonly",
    "hint_idempotency_verified", "max_attempts", "timeout_ms", "grace_ms", "risk_level",
    "status", "failure_class", "cause", "resolution", "flags", "attempt_count",
    "in_flight_attempt", "event_count", "head_hash", "updated_at", "flagged_at", "assignee",
)  # fmt: skip
STATUSES = ("succeeded", "succeeded", "succeeded", "failed", "retry_allowed", "escalated")


def event_actor(n: int) -> str:
    """Two people's events, for the search by operator to find: olga acted on one
    invocation in a thousand, pat on one in a hundred."""
    if n % 1000 == 7:
        return "user:olga"
    return "user:pat" if n % 100 == 3 else "runtime:bench"


def event_data(n: int) -> dict[str, Any]:
    if n % 10 == 1:
        return {"n": n, "business_reference": f"RF-{n // 20}"}
    return {"n": n}


def timed(read: Callable[[], Any]) -> dict[str, float]:
    """p50 and max of ten reads, in ms; each must answer 200."""
    samples = []
    for _ in range(10):
        started = time.perf_counter()
        answer = read()
        samples.append(time.perf_counter() - started)
        assert getattr(answer, "status_code", 200) == 200, answer
    return {
        "p50_ms": round(statistics.median(samples) * 1000, 1),
        "max_ms": round(max(samples) * 1000, 1),
    }


def downloaded(response: Any) -> Any:
    """A streamed response, read to its end (and so closed)."""
    b"".join(response.streaming_content)
    response.close()
    return response


class Command(BaseCommand):
    help = "Benchmark audit search, export and verification over 1,000,000 invocations."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--invocations", type=int, default=1_000_000)

    def handle(self, *args: Any, invocations: int, **options: Any) -> None:
        database = settings.DATABASES["default"]
        name = f"{database['NAME']}_bench_audit"
        admin = psycopg.conninfo.make_conninfo(
            host=str(database["HOST"]) or None, port=str(database["PORT"]) or None,
            user=str(database["USER"]) or None, dbname="postgres",
        )  # fmt: skip
        conninfo = psycopg.conninfo.make_conninfo(admin, dbname=name)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        user, host = database["USER"] or "postgres", database["HOST"] or ""
        url = f"postgresql://{user}@{host}:{database['PORT'] or 5432}/{name}"
        env = {**os.environ, "DATABASE_URL": url}
        migrate = [sys.executable, "manage.py", "migrate", "-v", "0"]
        subprocess.run(migrate, env=env, check=True)
        started = time.perf_counter()
        self.generate(conninfo, invocations)
        generated = time.perf_counter() - started
        from django.db import connection, connections

        connections.close_all()
        connection.settings_dict["NAME"] = name
        results: dict[str, Any] = {
            "invocations": invocations,
            "generate_seconds": round(generated, 1),
            "search": self.search(),
            "export": self.export(env),
            "verify": self.verify(),
            "background": self.background(invocations),
            "console": self.console(),
        }
        self.report(results)

    def generate(self, conninfo: str, count: int) -> None:
        start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        with psycopg.connect(conninfo) as conn:
            runtimes = [
                conn.execute(
                    "INSERT INTO ledger_runtime (name, created_at) VALUES (%s, now()) RETURNING id",
                    [f"runtime-{n}"],
                ).fetchone()[0]  # type: ignore[index]
                for n in range(2)
            ]
            columns = ", ".join(COLUMNS)
            with (
                conn.cursor() as cursor,
                cursor.copy(f"COPY ledger_invocation ({columns}) FROM STDIN") as copy,
            ):
                for n in range(count):
                    created = start + dt.timedelta(seconds=n * 31_536_000 // count)
                    head = self.event_hash(n, created)
                    flags = "{undeclared}" if n % 50 == 0 else "{}"
                    if n % 600 == 5:  # the queue's conflicts of evidence (below)
                        flags = "{evidence_conflict}"
                    status = STATUSES[n % len(STATUSES)]
                    flagged_at = created if status == "escalated" else None
                    # Of the queue, one in 100 is a conflict of evidence, one in 1,000
                    # is claimed by the benchmark's operator.
                    cause = "evidence_conflict" if n % 600 == 5 else "no_probe"
                    assignee = "bench-operator" if n % 6000 == 5 else ""
                    copy.write_row((
                        f"inv-{n}", runtimes[n % 2], f"task-{n % 50_000}", f"cap.{n % 20}",
                        f"customer:{n % 10_000}", f"key-{n}", "sha256:" + "0" * 64, "",
                        created, False, False, 5, 30000, 60000, "medium",
                        status, "", cause if flagged_at else "", "", flags, 1, "", 1, head,
                        created, flagged_at, assignee if flagged_at else "",
                    ))  # fmt: skip
            # As event_actor and event_data, which event_hash's body holds: every tenth
            # event names a business reference, and every reference is named by two.
            conn.execute(
                "CREATE FUNCTION pg_temp.event_data(n int) RETURNS jsonb LANGUAGE sql AS $$ "
                "SELECT CASE WHEN n % 10 = 1 THEN jsonb_build_object('n', n, "
                "'business_reference', 'RF-' || n / 20) ELSE jsonb_build_object('n', n) END $$"
            )
            # The months the invocations were recorded in get their partitions, as beat
            # would have made them.
            conn.execute("SELECT ledger_create_event_partitions(%s, now())", [start])
            conn.execute(
                "INSERT INTO ledger_event (invocation_id, invocation_created_at, seq, kind, "
                "actor, data, created_at, prev_hash, hash) SELECT i.id, i.created_at, 1, "
                "'intent_recorded', "
                "CASE WHEN n % 1000 = 7 THEN 'user:olga' WHEN n % 100 = 3 THEN 'user:pat' "
                "ELSE 'runtime:bench' END, "
                "pg_temp.event_data(n), i.created_at, repeat('0', 64), i.head_hash "
                "FROM ledger_invocation i, CAST(substr(i.invocation_id, 5) AS int) AS n"
            )
            conn.commit()
            conn.autocommit = True
            conn.execute("VACUUM ANALYZE ledger_invocation")
            conn.execute("VACUUM ANALYZE ledger_event")

    @staticmethod
    def event_hash(n: int, created: dt.datetime) -> str:
        body = {
            "invocation_id": f"inv-{n}", "seq": 1, "kind": "intent_recorded",
            "actor": event_actor(n), "data": event_data(n),
            "created_at": created.isoformat(), "prev_hash": chain.GENESIS_HASH,
        }  # fmt: skip
        return chain.event_hash(chain.GENESIS_HASH, body)

    def search(self) -> dict[str, Any]:
        from ledger.audit import search

        month = {"since": dt.datetime(2026, 3, 1, tzinfo=dt.UTC),
                 "until": dt.datetime(2026, 4, 1, tzinfo=dt.UTC)}  # fmt: skip
        filters: dict[str, dict[str, Any]] = {
            "no filter": {},
            "runtime": {"runtime": "runtime-1"},
            "status": {"status": "escalated"},
            "capability": {"capability": "cap.7"},
            "subject": {"subject": "customer:4242"},
            "task": {"task_id": "task-777"},
            "month": month,
            "flag": {"flag": "undeclared"},
            "flag, 1 in 600": {"flag": "evidence_conflict"},
            # Finds nothing, on purpose: without its index, the slowest search of all.
            "flag, none carries it": {"flag": "approval_missing"},
            "cause, 1 in 6,000": {"cause": "evidence_conflict"},
            "cause, none has it": {"cause": "proposal_rejected"},
            "capability + month": {"capability": "cap.3", **month},
            "operator": {"operator": "olga"},
            "operator + month": {"operator": "olga", **month},
            "operator, 10 times as busy": {"operator": "pat"},
            "business reference": {"business_reference": "RF-42"},
            "business reference + month": {"business_reference": "RF-10000", **month},
        }
        timings: dict[str, Any] = {}
        for label, data in filters.items():
            samples = []
            for _ in range(20):
                started = time.perf_counter()
                found = len(search(data)[:51])
                samples.append(time.perf_counter() - started)
            samples.sort()
            timings[label] = {
                "p50_ms": round(statistics.median(samples) * 1000, 2),
                "p95_ms": round(samples[int(len(samples) * 0.95) - 1] * 1000, 2),
                "rows": found,  # of at most 51: a search that finds nothing is no test
            }
        return timings

    def export(self, env: dict[str, str]) -> dict[str, Any]:
        # A window with 200,000 events, exported by a separate process so that its peak
        # RSS is its own.
        since, until = "2026-01-01T00:00:00+00:00", "2026-03-15T00:00:00+00:00"
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "manage.py", "export_audit", "--since", since, "--until", until],
            env=env, check=True, stdout=subprocess.PIPE,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        rows = result.stdout.count(b"\n") - 1
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        return {
            "rows": rows,
            "seconds": round(seconds, 2),
            "rows_per_second": round(rows / seconds, 1),
            "peak_rss_mb": round(max(peak, before) / 1024, 1),
        }

    def verify(self) -> dict[str, Any]:
        from ledger.integrity import verify

        since = dt.datetime(2026, 6, 1, tzinfo=dt.UTC)
        until = dt.datetime(2026, 6, 15, tzinfo=dt.UTC)
        started = time.perf_counter()
        report = verify(since=since, until=until)
        seconds = time.perf_counter() - started
        return {
            "events": report.events,
            "ok": report.ok,
            "seconds": round(seconds, 2),
            "events_per_second": round(report.events / seconds, 1),
        }

    def background(self, invocations: int) -> dict[str, Any]:
        """Slices of the background verification at the default size (a new pass's
        first ones: from the oldest invocation), and what they make a whole pass.

        Every generated row reads as a break (its intent's actor is `runtime:bench`, not
        its runtime), so each slice also records one per invocation: its slowest case.
        Their log lines are left out of the output."""
        from ledger.integrity import log, verify_next_slice

        size, took, found = settings.LEDGER_VERIFY_SLICE, [], 0
        log.disabled = True
        for _ in range(5):
            started = time.perf_counter()
            verified = verify_next_slice(invocations=size)
            took.append(time.perf_counter() - started)
            assert verified is not None
            found = verified.break_count
        log.disabled = False
        # A run checks slices until it has spent LEDGER_VERIFY_SECONDS, the last one
        # overrunning it: at least one.
        slices_a_run = max(math.ceil(settings.LEDGER_VERIFY_SECONDS / statistics.median(took)), 1)
        runs = math.ceil(invocations / (size * slices_a_run))
        return {
            "slice_invocations": size,
            "slice_p50_ms": round(statistics.median(took) * 1000, 1),
            "slice_max_ms": round(max(took) * 1000, 1),
            "breaks": found,
            "slices_a_run": slices_a_run,
            "pass_hours_at_defaults": round(
                runs * settings.LEDGER_VERIFY_INTERVAL_SECONDS / 3600, 1
            ),
        }

    def console(self) -> dict[str, Any]:
        """The console's pages as an operator opens them, and a /metrics scrape, with
        one invocation in six escalated: 166,667 in the queue at a million, the backlog
        of an outage that flagged every invocation in flight."""
        from django.contrib.auth.models import Group, User
        from django.test import Client

        from ledger.metrics import exposition
        from ledger.models import RISK_FIRST, Invocation
        from reconciliation.views import queue_position

        user = User.objects.create_user("bench-operator")
        user.groups.add(Group.objects.get_or_create(name="operator")[0])
        client = Client(HTTP_HOST=settings.ALLOWED_HOSTS[0])
        client.force_login(user)
        # Where the 1,000th page of 100 starts: read once by OFFSET, as no page is.
        deep = (
            Invocation.objects.flagged()
            .annotate(risk_rank=RISK_FIRST)
            .order_by("risk_rank", "flagged_at", "id")[99_999]
        )
        pages = {
            "queue": "/",
            "queue, page 1,001": f"/?after={queue_position(deep)}",
            "queue, 1 cause in 100": "/?cause=evidence_conflict",
            "queue, claimed by me": "/?mine=mine",
            "queue's live counts": "/queue/counts",
            "dashboard": "/dashboard/",
            "action log": "/audit/actions/",
            # With the scopes called undeclared in the last week: one invocation in 50.
            "capabilities": "/audit/capabilities/",
        }
        reads: dict[str, Any] = {
            label: (lambda path=path: client.get(path)) for label, path in pages.items()
        }
        # As htmx asks for them when a filter is applied or the next page is opened: the
        # rows alone, without the counts that the whole page shows.
        htmx = {"HX-Request": "true"}
        for label in ("queue, page 1,001", "queue, 1 cause in 100", "queue, claimed by me"):
            path = pages[label]
            reads[f"{label}, htmx"] = lambda path=path: client.get(path, headers=htmx)
        reads["/metrics scrape"] = exposition
        # A compliance reviewer's bundle of a search: June 1, 00:00-07:00, about 800
        # invocations, built and read whole.
        seven_hours = {"since": "2026-06-01 00:00", "until": "2026-06-01 07:00"}
        reads["evidence bundle, a search of 7 hours"] = lambda: downloaded(
            client.get("/audit/bundle.zip", seven_hours)
        )
        timings = {label: timed(read) for label, read in reads.items()}
        self.rerun_probes(1000)
        timings["action log, a re-run of 1,000 on top"] = timed(reads["action log"])
        return timings

    def rerun_probes(self, count: int) -> None:
        """An operator's re-run of the probes of `count` escalations of one capability,
        in the request's batches: an event on each, one line of the action log."""
        from ledger.models import PROBE_COULD_SETTLE, Capability, Invocation
        from reconciliation.services import probes_requested
        from reconciliation.tasks import REQUEST_BATCH

        waiting = Invocation.objects.filter(
            status="escalated", assignee="", cause__in=PROBE_COULD_SETTLE
        )
        scope = waiting.values_list("capability_scope", flat=True).first()
        assert scope is not None, "the generated ledger escalates one invocation in six"
        escalated = waiting.filter(capability_scope=scope).order_by("pk")
        ids = list(escalated.values_list("invocation_id", flat=True)[:count])
        # The scratch database registers no capability; its events name the scope alone.
        named = Capability(scope=scope)
        for batch in itertools.batched(ids, REQUEST_BATCH):
            probes_requested(capability=named, invocation_ids=batch, actor="user:pat")

    def report(self, results: dict[str, Any]) -> None:
        out = self.stdout.write
        out(f"{results['invocations']} invocations COPYed in {results['generate_seconds']} s")
        out(f"{'audit search (first page)':<32}{'p50 ms':>10}{'p95 ms':>10}{'rows':>8}")
        for label, t in results["search"].items():
            out(f"{label:<32}{t['p50_ms']:>10}{t['p95_ms']:>10}{t['rows']:>8}")
        export = results["export"]
        out(
            f"export: {export['rows']} rows in {export['seconds']} s "
            f"({export['rows_per_second']}/s), exporter peak RSS {export['peak_rss_mb']} MB"
        )
        check = results["verify"]
        out(
            f"verify_ledger: {check['events']} events in {check['seconds']} s "
            f"({check['events_per_second']}/s), ok={check['ok']}"
        )
        slices = results["background"]
        out(
            f"background verification: a slice of {slices['slice_invocations']} invocations "
            f"in {slices['slice_p50_ms']} ms p50 (max {slices['slice_max_ms']}), "
            f"{slices['breaks']} breaks; {slices['slices_a_run']} a run, a whole pass "
            f"{slices['pass_hours_at_defaults']} h at the defaults"
        )
        out(f"{'console (one invocation in 6 queued)':<36}{'p50 ms':>8}{'max ms':>10}")
        for label, t in results["console"].items():
            out(f"{label:<36}{t['p50_ms']:>8}{t['max_ms']:>10}")
        out(json.dumps(results, sort_keys=True))
