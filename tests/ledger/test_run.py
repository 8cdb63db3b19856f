"""`make run`: its embedded PostgreSQL starts again after a crash and stops with the
ledger, Ctrl-C leaves no process of the ledger behind, and a second one on a taken
address starts nothing."""

from __future__ import annotations

import datetime as dt
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from django.utils import timezone
from gunicorn.ctl.client import ControlClient

from ledger import run
from ledger.models import Capability, Invocation
from tests.conftest import (
    LOG_RECORD,
    LOG_TIME,
    ROOT,
    Api,
    wait_for,
)
from tests.running import Ledger, live_processes, make_run

START = (
    "from ledger.run import start_embedded_postgres; server = start_embedded_postgres(); "
    "print(server.get_pid(), flush=True); {then}"
)


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Not under pytest's 0700 tmp: as root, pgserver runs PostgreSQL as its own user.
    path = Path(tempfile.mkdtemp(prefix="ledger-run-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for pid in postgres_of(path):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)


def embedded(data_dir: Path, then: str) -> subprocess.Popen[str]:
    env = {**os.environ, "LEDGER_DATA_DIR": str(data_dir)}
    return subprocess.Popen(
        [sys.executable, "-c", START.format(then=then)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


# A process that holds on until it is killed: it waits for input that never comes.
HOLD = "import sys; sys.stdin.read()"


def in_group(group: int) -> list[int]:
    """The live processes of a process group."""
    return [pid for pid, (_, pgrp, _) in live_processes().items() if pgrp == group]


def postgres_of(data_dir: Path) -> list[int]:
    """The live PostgreSQL servers of this data directory (`postgres -D <dir>`)."""
    pgdata = os.fsencode(data_dir / "pg")
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            arguments = (proc / "cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if pgdata in arguments:
            found.append(int(proc.name))
    return found


def has_exited(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_it_starts_after_a_crash_left_its_pid_to_another_process(data_dir: Path) -> None:
    ledger = embedded(data_dir, then=HOLD)
    assert ledger.stdout is not None
    assert ledger.stdout.readline().startswith("embedded PostgreSQL ready")
    postmaster = int(ledger.stdout.readline())
    # The machine dies: the ledger and PostgreSQL, with all its processes, are
    # killed, and nothing cleans up.
    group = os.getpgid(postmaster)
    assert group != os.getpgid(0)
    os.killpg(group, signal.SIGKILL)
    ledger.kill()
    ledger.wait()
    wait_for(lambda: not in_group(group))
    # After the restart, the dead server's PID belongs to some other process.
    impostor = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE)
    try:
        locks = [data_dir / "pg" / "postmaster.pid", *(data_dir / "pg").glob(".s.PGSQL.*.lock")]
        assert len(locks) == 2
        for lock in locks:
            lock.write_text(f"{impostor.pid}\n" + lock.read_text().split("\n", 1)[1])

        again = embedded(data_dir, then="print(server.psql('SELECT 42 AS answer;'))")
        output, _ = again.communicate(timeout=120)

        assert again.returncode == 0
        assert "removed a stale postmaster.pid" in output
        assert "42" in output.split("answer", 1)[1]
        # The dead ledger no longer counts as a user of the server: the one that
        # started it stopped it on the way out.
        assert not postgres_of(data_dir)
    finally:
        impostor.kill()
        impostor.wait()


def test_it_starts_without_a_warning_where_the_user_has_no_runtime_directory(
    data_dir: Path,
) -> None:
    """A root shell or CI sets no XDG_RUNTIME_DIR: platformdirs, asked for one by
    pgserver, warned at every start, before anything the ledger says."""
    env = {**os.environ, "LEDGER_DATA_DIR": str(data_dir)}
    env.pop("XDG_RUNTIME_DIR", None)
    started = subprocess.run(
        [sys.executable, "-c", START.format(then="")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0
    assert started.stdout.startswith("embedded PostgreSQL ready")
    assert started.stderr == ""


# Commits a row, says so, then on a line of input checks the server as `make run` does
# every half second, twice: once after the test has killed it, once more.
KEEP = (
    "import sys; from ledger.run import keep_embedded_postgres_running as keep; "
    "server.psql('CREATE TABLE kept (n int); INSERT INTO kept VALUES (42);'); "
    "print('committed', flush=True); sys.stdin.readline(); "
    "print('restarted', keep(server), server.get_pid(), flush=True); "
    "print('restarted', keep(server), flush=True); "
    "print(server.psql('SELECT n AS kept FROM kept;'))"
)


def test_an_embedded_postgres_killed_is_started_again_with_what_it_committed(
    data_dir: Path,
) -> None:
    ledger = embedded(data_dir, then=KEEP)
    assert ledger.stdout is not None
    assert ledger.stdout.readline().startswith("embedded PostgreSQL ready")
    postmaster = int(ledger.stdout.readline())
    assert ledger.stdout.readline() == "committed\n"
    os.killpg(os.getpgid(postmaster), signal.SIGKILL)  # the server and all its processes
    # Exiting, a process's command line empties before it stops running: `make run`
    # would start the server at its next look, half a second later, but the test
    # looks once.
    wait_for(lambda: not postgres_of(data_dir) and has_exited(postmaster))

    output, _ = ledger.communicate("check\n", timeout=120)
    assert ledger.returncode == 0, output
    first, second = [line.split() for line in output.splitlines() if line.startswith("restarted")]
    assert (first[:2], second) == (["restarted", "True"], ["restarted", "False"])
    assert int(first[2]) != postmaster
    assert "42" in output.split("kept", 1)[1]
    wait_for(lambda: not postgres_of(data_dir))  # stopped with its last user, as before


# A parent that starts a child and then waits: the child is what a gunicorn master
# leaves behind when it dies before its worker.
PARENT = (
    "import signal, subprocess, sys; "
    "subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()']); "
    "signal.pause()"
)


def test_stopping_a_child_stops_what_it_left_behind() -> None:
    parent = run.start([sys.executable, "-c", PARENT])
    try:
        assert os.getpgid(parent.pid) == parent.pid  # a group of its own
        wait_for(lambda: len(in_group(parent.pid)) == 2)

        run.stop([parent], timeout=5)

        assert parent.returncode == -signal.SIGTERM
        wait_for(lambda: not in_group(parent.pid), seconds=5)
    finally:
        for pid in in_group(parent.pid):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> set[int]:
    """The live processes below `pid`."""
    children: dict[int, list[int]] = {}
    for child, (parent, *_) in live_processes().items():
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def test_a_second_ledger_on_a_taken_address_says_so_and_starts_nothing() -> None:
    with socket.socket() as running:  # the first `make run`'s web server
        running.bind(("127.0.0.1", 0))
        running.listen()
        bind = f"127.0.0.1:{running.getsockname()[1]}"
        second = subprocess.run(
            [sys.executable, "-m", "ledger.run"],
            cwd=ROOT,
            # Servers that would refuse it: nothing may be reached before the check.
            env={
                **os.environ,
                "LEDGER_BIND": bind,
                "DATABASE_URL": "postgresql://postgres@127.0.0.1:1/unreachable",
                "CELERY_BROKER_URL": "memory://",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert second.returncode == 1
    assert second.stdout == ""
    assert second.stderr.endswith(
        f"{bind} is in use: is the ledger running already? Stop it (Ctrl-C where it runs), "
        "or set LEDGER_BIND to another address.\n"
    )


@pytest.mark.parametrize(
    ("bind", "in_use"),
    [
        ("{host}:{port}", True),
        ("[::1]:{port}", False),
        ("{host}:0", False),
        ("unix:/x", False),
        ("10.255.255.1:{port}", False),  # not this machine's: for gunicorn to report
    ],
)
def test_only_a_taken_tcp_address_counts_as_in_use(bind: str, in_use: bool) -> None:
    with socket.socket() as running:
        running.bind(("127.0.0.1", 0))
        running.listen()
        host, port = running.getsockname()
        assert run.address_in_use(bind.format(host=host, port=port)) is in_use


def test_an_address_family_this_machine_lacks_is_left_to_gunicorn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_ipv6(family: int) -> socket.socket:
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    monkeypatch.setattr(run.socket, "socket", no_ipv6)
    assert run.address_in_use("[::1]:8000") is False


def test_ctrl_c_stops_web_worker_and_beat_and_frees_the_port(
    transactional_db: None, tmp_path: Path
) -> None:
    with make_run(tmp_path, WEB_WORKERS="2") as ledger:
        wait_for(ledger.ready, seconds=120)
        # gunicorn, its two workers, two Celery workers, and beat.
        wait_for(lambda: len(descendants(ledger.process.pid)) >= 6)
        processes = descendants(ledger.process.pid)
        # Its gunicorn's control socket is in its data folder, and is this gunicorn's.
        control_socket = tmp_path / "data" / "gunicorn.ctl"
        with ControlClient(str(control_socket), timeout=10) as control:
            served_by = {
                worker["pid"] for worker in control.send_command("show workers")["workers"]
            }
        gunicorn = ledger.child("gunicorn")
        assert gunicorn is not None
        live = live_processes()
        assert served_by == {pid for pid in processes if live.get(pid, (0,))[0] == gunicorn}
        assert len(served_by) == 2

        os.killpg(ledger.process.pid, signal.SIGINT)

        assert ledger.process.wait(timeout=60) == 0
        assert processes.isdisjoint(live_processes())
        assert not control_socket.exists()
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", ledger.port)) != 0
        # gunicorn's own lines and its access log take the ledger's format too.
        err_lines = (tmp_path / "err").read_text().splitlines()
        booted = [line for line in err_lines if "Booting worker with pid" in line]
        assert len(booted) == 2
        assert all(LOG_RECORD.match(line) for line in booted)
        assert all("level=INFO logger=gunicorn.error " in line for line in booted)
        readyz = re.compile(
            LOG_TIME
            + r' level=INFO logger=gunicorn\.access remote=127\.0\.0\.1 request="GET /readyz '
            r'HTTP/1\.1" status=200 bytes=\d+ duration_ms=\d+ agent="'
        )
        assert any(readyz.match(line) for line in ledger.out.read_text().splitlines())


def test_a_worker_killed_is_started_again_however_soon_and_the_rest_keep_running(
    transactional_db: None, tmp_path: Path
) -> None:
    with make_run(tmp_path) as ledger:
        wait_for(ledger.ready, seconds=120)
        wait_for(lambda: ledger.child("celery", "worker") is not None)
        worker, web = ledger.child("celery", "worker"), ledger.child("gunicorn")
        assert worker is not None and web is not None

        name = os.fsdecode(next(word for word in run.command_line(worker) if word.endswith(b"@%h")))

        # By the kernel, three times in a row, each as soon as it is back: not a worker
        # failing to start, which would stop the ledger.
        def killed_and_back(killed: int) -> int:
            os.killpg(killed, signal.SIGKILL)
            wait_for(lambda: ledger.child("celery", "worker", name) not in {None, killed})
            back = ledger.child("celery", "worker", name)
            assert back is not None
            return back

        for _ in range(3):
            worker = killed_and_back(worker)
        number = name.removeprefix("worker").split("@")[0]
        said = ledger.out.read_text()
        assert said.count(f"worker-{number} exited with -9; starting it again") == 3
        assert ledger.child("gunicorn") == web and ledger.ready()
        assert ledger.process.poll() is None
        os.killpg(ledger.process.pid, signal.SIGINT)
        assert ledger.process.wait(timeout=60) == 0


def job_runners(ledger: Ledger) -> set[int]:
    """The processes of its Celery workers that run jobs: those with no process below."""
    below = descendants(ledger.process.pid)
    parents = {live_processes().get(pid, (0,))[0] for pid in below}
    return {pid for pid in below - parents if {b"celery", b"worker"} <= set(run.command_line(pid))}


@pytest.mark.django_db(transaction=True)
def test_any_process_running_jobs_killed_alone_leaves_the_jobs_running(
    api: Api, refund: Capability, tmp_path: Path
) -> None:
    """The kernel kills one process for memory, not a worker's whole group. On the
    embedded broker, which has no event loop, Celery's prefork pool fed its processes
    from one pipe behind one lock, which an idle process holds while it waits for a job:
    killed, it left the lock held, and the worker never ran a job again (seen with
    py-spy)."""
    with make_run(
        tmp_path, CELERY_BROKER_URL="filesystem://localhost//", LEDGER_SWEEP_INTERVAL_SECONDS="1"
    ) as ledger:
        wait_for(ledger.ready, seconds=120)
        wait_for(lambda: len(job_runners(ledger)) >= 2)
        for pid in job_runners(ledger):
            os.kill(pid, signal.SIGKILL)
        api.intent(attempt_id="a1")
        Invocation.objects.update(deadline_at=timezone.now() - dt.timedelta(seconds=1))
        # Beat's sweep, run by a worker, flags it (and, with no probe, escalates it).
        wait_for(lambda: Invocation.objects.get().status != "in_flight")
        assert Invocation.objects.get().failure_class == "post_dispatch_evidence_failed"


def test_a_child_that_cannot_start_stops_the_ledger_after_three_tries(
    transactional_db: None, tmp_path: Path
) -> None:
    with make_run(tmp_path, WEB_THREADS="many") as ledger:
        assert ledger.process.wait(timeout=120) == 1
        said = ledger.out.read_text()
        assert said.count("web exited with 2; starting it again") == 2
        assert f"web exited with 2, 3 times within {run.QUICK_EXIT_SECONDS} s" in said
        assert not descendants(ledger.process.pid)


@pytest.mark.parametrize(("name", "count"), [("WORKER_CONCURRENCY", "0"), ("PROBE_THREADS", "4.5")])
def test_a_count_of_workers_or_threads_below_one_is_refused_before_anything_starts(
    transactional_db: None, tmp_path: Path, name: str, count: str
) -> None:
    with make_run(tmp_path, **{name: count}) as ledger:
        assert ledger.process.wait(timeout=60) == 2
        assert (
            f"{name} must be a whole number, at least 1, not '{count}'"
            in (tmp_path / "err").read_text()
        )
        assert not (tmp_path / "data").exists()
