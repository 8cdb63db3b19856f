from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ledger.models import Capability, Invocation
from reconciliation.standin import StandInService
from tests.conftest import Api, process_env, registered

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandInService]:
    service = StandInService(tmp_path / "standin.sqlite3", slow_seconds=30).start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def refunds(db: None, standin: StandInService) -> Capability:
    """refund.create, probed by idempotency key at the stand-in; short deadlines."""
    return registered(
        "refund.create",
        risk_level="medium",
        timeout_ms=200,
        settings={"grace_ms": 100, "probe": standin.probe_config()},
    )


def perform_refund(standin: StandInService, key: str, amount: int = 25) -> httpx.Response:
    """What the runtime's tool call does: the real business effect."""
    return httpx.post(
        f"{standin.url}/refunds", json={"idempotency_key": key, "order": "SO-1", "amount": amount}
    )


def reported_lost(api: Api, invocation_id: str, capability: str = "refund.create") -> None:
    """An invocation whose runtime reported its outcome lost: in the queue for a probe."""
    api.intent(
        invocation_id=invocation_id,
        idempotency_key=f"k-{invocation_id}",
        capability=capability,
        attempt_id="a1",
    )
    api.outcome(invocation_id, "a1", kind="post_dispatch_evidence_failed")


def status_of(invocation_id: str) -> str:
    return Invocation.objects.get(invocation_id=invocation_id).status


class BrokerQueue:
    """This test database's queues on the real broker (its jobs and its probes),
    emptied for the test."""

    def __init__(self) -> None:
        from ledger.celery import app

        self.app, self.names = app, [queue.name for queue in app.conf.task_queues]
        with app.connection_for_write() as broker:
            for name in self.names:
                broker.default_channel.queue_purge(name)

    def jobs(self) -> int:
        """The messages waiting in them."""
        with self.app.connection_for_read() as broker:
            return sum(
                int(broker.default_channel.queue_declare(queue=name).message_count)
                for name in self.names
            )


@pytest.fixture
def broker_queue() -> BrokerQueue:
    return BrokerQueue()


@dataclass
class Workers:
    """Real Celery worker processes on the real broker and the test database."""

    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(
        self,
        *,
        log: Path | None = None,
        pool: str | None = "solo",
        concurrency: int | None = None,
        **env: str,
    ) -> subprocess.Popen[bytes]:
        """A worker; its log (standard error) goes to `log` if given. With no `pool`, the
        settings choose, as for a worker started by hand."""
        return self._run(
            ["worker", *(["--pool", pool] if pool else []),
             *(["--concurrency", str(concurrency)] if concurrency else []), "--without-gossip",
             "--without-mingle", "--without-heartbeat", "-n", f"w{len(self.processes)}@%h"],
            log, env,
        )  # fmt: skip

    def beat(
        self, tmp_path: Path, *, log: Path | None = None, **env: str
    ) -> subprocess.Popen[bytes]:
        """Celery beat on the project's static schedule (the sweep every second)."""
        return self._run(
            ["beat", "--schedule", str(tmp_path / "beat-schedule")],
            log,
            {"LEDGER_SWEEP_INTERVAL_SECONDS": "1", **env},
        )

    def _run(
        self, arguments: list[str], log: Path | None, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        with open(log, "wb") if log else nullcontext(None) as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "ledger", *arguments],
                cwd=ROOT, env={**self.env, "LOG_LEVEL": "WARNING", **env}, stderr=stderr,
            )  # fmt: skip
        self.processes.append(process)
        return process

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture
def workers(transactional_db: None) -> Iterator[Workers]:
    from ledger.celery import app

    app.control.purge()
    pool = Workers(process_env())
    try:
        yield pool
    finally:
        pool.stop_all()
        app.control.purge()
