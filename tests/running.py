"""A `make run` ledger under test, on the test database, and the processes it starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from ledger import run
from tests.conftest import ROOT, answers_200, process_env


def live_processes() -> dict[int, tuple[int, int, int]]:
    """Every process that is not a zombie: pid -> (parent pid, process group, session)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            # Fields after the command's closing parenthesis: state, ppid, pgrp, session.
            state, ppid, pgrp, sid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[:4]
        except FileNotFoundError:
            continue
        if state != "Z":
            found[int(proc.name)] = (int(ppid), int(pgrp), int(sid))
    return found


def in_session(session: int) -> list[int]:
    """The live processes of a session."""
    return [pid for pid, (*_, sid) in live_processes().items() if sid == session]


class Ledger(NamedTuple):
    process: subprocess.Popen[bytes]
    port: int
    out: Path
    err: Path

    def ready(self) -> bool:
        return answers_200(f"http://127.0.0.1:{self.port}/readyz")

    def child(self, *words: str) -> int | None:
        """The PID of its child whose command has these words, if it runs."""
        for pid, (parent, *_) in live_processes().items():
            if parent == self.process.pid and set(map(os.fsencode, words)) <= set(
                run.command_line(pid)
            ):
                return pid
        return None


@contextmanager
def make_run(tmp_path: Path, **env: str) -> Iterator[Ledger]:
    """`make run` on the test database, in a session of its own as in a terminal
    (Ctrl-C signals its group); whatever of it is left at the end is killed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        ledger = subprocess.Popen(
            [sys.executable, "-m", "ledger.run"],
            cwd=ROOT,
            env={
                **process_env(),
                "LEDGER_BIND": f"127.0.0.1:{port}",
                "LEDGER_DATA_DIR": str(tmp_path / "data"),
                **env,
            },
            start_new_session=True,
            stdout=stdout,
            stderr=stderr,
        )
    try:
        yield Ledger(ledger, port, out, err)
    finally:
        # Its session, which every process it started stays in, even one orphaned.
        ledger.kill()
        ledger.wait()
        for pid in in_session(ledger.pid):
            os.kill(pid, signal.SIGKILL)
