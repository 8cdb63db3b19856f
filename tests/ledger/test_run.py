"""`make run`'s embedded PostgreSQL starts again after a crash, and stops with the ledger."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_for

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
    alive = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            # Fields after the command's closing parenthesis: state, ppid, pgrp.
            state, _, pgrp = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except FileNotFoundError:
            continue
        if int(pgrp) == group and state != "Z":
            alive.append(int(proc.name))
    return alive


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
