"""Run the whole ledger on one machine: web (gunicorn), Celery workers and beat.

    python -m ledger.run            (what `make run` does)

With no DATABASE_URL it starts the embedded PostgreSQL from the pgserver wheel under
.data/pg; with no CELERY_BROKER_URL the workers and beat use the embedded broker
(ledger/broker.py) under .data/broker. Both are the settings' defaults, so `manage.py`
commands run beside it reach the same database and broker. What exits is started again
(`Child`, `keep_embedded_postgres_running`); Ctrl-C stops everything.

The workers are WORKER_CONCURRENCY (2) Celery workers of one process each, not one
worker with a prefork pool: on a broker without an event loop, as the embedded one,
the prefork pool hands jobs to its processes through one pipe behind one lock, which
an idle process holds while it waits; one process killed alone (by the kernel, for
memory) left the lock held, and the worker never ran a job again. A worker of one
process dies whole, and `Child` starts it again. The first of two or more runs one job
at a time (`--pool solo`) and takes no probe jobs, so that the sweep, the sealer and
the verification run while a business system's outage holds the others in probes
that wait out their timeouts. The others run PROBE_THREADS (4) jobs at once in
threads: a probe mostly waits for a business system to answer.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

BIND = os.environ.get("LEDGER_BIND", "127.0.0.1:8000")
# Counts from the environment, with their defaults: Celery workers, and the threads of
# each worker that takes probe jobs.
COUNTS = {"WORKER_CONCURRENCY": "2", "PROBE_THREADS": "4"}


def start_embedded_postgres() -> object:
    with warnings.catch_warnings():
        # pgserver asks platformdirs for the user's runtime directory (for its lock file)
        # as it is imported. Without XDG_RUNTIME_DIR (a root shell, CI) platformdirs
        # warns, at every start, and takes /tmp/runtime-UID, which serves as well.
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        import pgserver  # only needed on embedded defaults

    from ledger import settings

    settings.EMBEDDED_PG_DIR.mkdir(parents=True, exist_ok=True)
    clear_crash_leftovers(settings.EMBEDDED_PG_DIR)
    server = pgserver.get_server(settings.EMBEDDED_PG_DIR, cleanup_mode="stop")
    exists = server.psql("SELECT 1 FROM pg_database WHERE datname = 'ledger';")
    if "(1 row)" not in exists:
        server.psql("CREATE DATABASE ledger;")
    print(f"embedded PostgreSQL ready in {settings.EMBEDDED_PG_DIR}", flush=True)
    return server


def keep_embedded_postgres_running(server: Any) -> bool:
    """Start the embedded PostgreSQL again if it is gone (killed by the kernel for
    memory, say), as a supervisor would; True if it had to. It recovers from its
    write-ahead log as after a power cut, so nothing committed is lost, and the web
    processes reconnect by themselves: until then they answer 503 ledger_unavailable,
    safe to resend. Raises what pgserver raises when it cannot start it."""
    import psutil

    from ledger import settings

    postmaster = server.get_postmaster_info().process
    with contextlib.suppress(psutil.NoSuchProcess):
        # psutil knows a PID taken by another process since; a killed server is a
        # zombie until the machine's init reaps it, and psutil says a zombie runs.
        if postmaster.is_running() and postmaster.status() != psutil.STATUS_ZOMBIE:
            return False

    clear_crash_leftovers(settings.EMBEDDED_PG_DIR)
    with server._lock:  # what pgserver holds around its own start
        server.ensure_postgres_running()
    return True


def clear_crash_leftovers(pgdata: Path) -> None:
    """Remove what a crash left in the embedded PostgreSQL's directory.

    Killed with the machine (a crash, a power cut, a container stopped), the ledger
    leaves files behind that name processes:
    - postmaster.pid and the socket's lock (.s.PGSQL.<port>.lock, in the same
      directory) name the server's PID, which can belong to another process after
      a restart. pgserver then takes that process for the server and starts none,
      and PostgreSQL refuses to start. Each is removed unless its process is a
      PostgreSQL of this directory.
    - pgserver's list of the processes using the server (.handle_pids.json). A dead
      one stays listed, and pgserver then never stops the server when the ledger
      stops. Dead processes are taken off.
    Linux only, through /proc; elsewhere all are left as they are.
    """
    if not Path("/proc/self").is_dir():
        return
    ours = {os.fsencode(pgdata), os.fsencode(pgdata.resolve())}
    for lock in [pgdata / "postmaster.pid", *pgdata.glob(".s.PGSQL.*.lock")]:
        if not lock.exists():
            continue
        pid = lock.read_text().split("\n", 1)[0].strip()
        argv = command_line(int(pid)) if pid.isdigit() else []
        if not (argv and Path(os.fsdecode(argv[0])).name == "postgres" and ours & set(argv)):
            lock.unlink()
            print(f"removed a stale {lock.name} (PID {pid} is not its PostgreSQL)", flush=True)
    handles = pgdata / ".handle_pids.json"
    if handles.exists():
        listed = json.loads(handles.read_text())
        handles.write_text(json.dumps([holder for holder in listed if command_line(holder)]))


def command_line(pid: int) -> list[bytes]:
    """The process's arguments, or [] if there is no such process."""
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return []
    return arguments.split(b"\0") if arguments else []  # a zombie has none


def probe_queue() -> str:
    """The queue of the probe jobs, as the settings name it."""
    from django.conf import settings

    return str(settings.LEDGER_PROBE_QUEUE)


def manage(*args: str) -> None:
    subprocess.run([sys.executable, "manage.py", *args], check=True)


def address_in_use(bind: str) -> bool:
    """Whether something listens on gunicorn's TCP `bind` (HOST:PORT, [HOST]:PORT or
    HOST, as gunicorn takes it) already. Bound as gunicorn binds, with SO_REUSEADDR,
    so a port that only a closed connection still holds is free, as gunicorn finds it.
    A unix socket or a descriptor is left for gunicorn to judge."""
    if bind.startswith(("unix:", "fd://")):
        return False
    host, colon, port = bind.rpartition(":")
    if not colon or host.endswith(":"):  # HOST alone, or a bare IPv6 address
        host, port = bind, "8000"
    host = host.strip("[]")
    if not port.isdigit():
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
    except OSError as error:  # in use, or no such address or family here: gunicorn says
        return error.errno == errno.EADDRINUSE
    return False


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ledger.settings")
    if address_in_use(BIND):
        # Found before anything starts: gunicorn would find it only after a second
        # worker and beat had joined the running ledger's broker.
        print(
            f"{BIND} is in use: is the ledger running already? Stop it (Ctrl-C where it "
            "runs), or set LEDGER_BIND to another address.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    counts = {name: os.environ.get(name, default) for name, default in COUNTS.items()}
    for name, count in counts.items():
        if not (count.isdecimal() and int(count) >= 1):
            print(f"{name} must be a whole number, at least 1, not {count!r}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 2
    workers, probe_threads = int(counts["WORKER_CONCURRENCY"]), counts["PROBE_THREADS"]
    server = None if "DATABASE_URL" in os.environ else start_embedded_postgres()
    manage("migrate", "--no-input")
    manage("collectstatic", "--no-input", "--verbosity", "0")
    python = sys.executable
    commands = {
        "web": [
            python, "-m", "gunicorn", "ledger.wsgi", "--bind", BIND,
            "--config", "python:ledger.gunicorn_conf", "--worker-class", "gthread",
            "--workers", os.environ.get("WEB_WORKERS", "2"),
            "--threads", os.environ.get("WEB_THREADS", "8"),
        ],
        **{
            f"worker-{n}": [
                python, "-m", "celery", "-A", "ledger", "worker", "--hostname", f"worker{n}@%h",
                *(["--pool", "solo", "--exclude-queues", probe_queue()] if n == 1 and workers > 1
                  else ["--pool", "threads", "--concurrency", probe_threads]),
            ]
            for n in range(1, workers + 1)
        },
        "beat": [python, "-m", "celery", "-A", "ledger", "beat"],
    }  # fmt: skip
    children = {name: Child(name, command) for name, command in commands.items()}
    print(
        f"ledger running (web, {workers} Celery workers and beat); Ctrl-C stops.\n"
        f"  console   http://{BIND}/  (a login: uv run python manage.py createsuperuser)\n"
        f"  API docs  http://{BIND}/api/docs/  (a runtime token: "
        "uv run python manage.py create_runtime NAME)",
        flush=True,
    )

    stopping = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    exit_code = 0
    while not stopping:
        for child in children.values():
            if not child.keep_running():
                exit_code, stopping = 1, True
        if server is not None and not stopping:
            try:
                if keep_embedded_postgres_running(server):
                    print("embedded PostgreSQL had exited; started it again", flush=True)
            except Exception as error:  # pg_ctl failed, timed out, or pgserver gave up
                print(f"embedded PostgreSQL exited and did not start again ({error!r}); "
                      "stopping the ledger", flush=True)  # fmt: skip
                exit_code, stopping = 1, True
        time.sleep(0.5)
    stop(child.process for child in children.values())
    del server  # pgserver stops the embedded PostgreSQL when the last user lets go
    return exit_code


# A child that exits sooner than this after it started, this many times in a row, is
# failing to start (a setting it refuses, say): the ledger stops rather than loop. One
# killed with SIGKILL (by the kernel for memory, or a person) did not fail: however
# soon and often, it is started again.
QUICK_EXIT_SECONDS = 10
QUICK_EXITS = 3


class Child:
    """Web, worker or beat, started again when it exits, as a supervisor would: one
    killed (by the kernel for memory, say) or stopped by a fault of its own leaves
    the rest running, and runtimes keep recording while it comes back."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name, self.command = name, command
        self.quick_exits = 0
        self.process = start(command)
        self.started = time.monotonic()

    def keep_running(self) -> bool:
        """Start it again if it has exited; False when it keeps failing to start."""
        code = self.process.poll()
        if code is None:
            return True
        stop([self.process])  # whatever it left in its group (a pool's processes)
        quick = time.monotonic() - self.started < QUICK_EXIT_SECONDS and code != -signal.SIGKILL
        self.quick_exits = self.quick_exits + 1 if quick else 0
        if self.quick_exits >= QUICK_EXITS:
            print(
                f"{self.name} exited with {code}, {QUICK_EXITS} times within "
                f"{QUICK_EXIT_SECONDS} s of starting; stopping the ledger",
                flush=True,
            )
            return False
        print(f"{self.name} exited with {code}; starting it again", flush=True)
        self.process = start(self.command)
        self.started = time.monotonic()
        return True


def start(command: list[str]) -> subprocess.Popen[bytes]:
    """A child in a process group of its own, led by it.

    Ctrl-C in a terminal signals the whole foreground group. In it, each gunicorn
    worker got SIGINT from the terminal and SIGQUIT from its master at the same
    moment; gunicorn's gthread worker shuts its thread pool down in both handlers,
    and when the second arrived inside the first, it deadlocked on the pool's lock
    and outlived everything, holding the port (seen with py-spy). Out of that
    group, each child hears only the SIGTERM `stop` sends it.
    """
    return subprocess.Popen(command, process_group=0)


def stop(children: Iterable[subprocess.Popen[bytes]], timeout: float = 15) -> None:
    """SIGTERM to each child (gunicorn and Celery then stop their own processes
    gracefully), then, after at most `timeout` seconds, SIGKILL to whatever is left
    in each child's group: nothing of the ledger outlives it, not even a process its
    parent failed to stop."""
    children = list(children)
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=max(deadline - time.monotonic(), 0))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


if __name__ == "__main__":
    sys.exit(main())
