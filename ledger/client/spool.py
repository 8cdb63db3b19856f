"""A durable local spool of outcome reports the ledger could not take.

One JSON record per line, each with a CRC32 of its body, appended and fsynced before
the caller is answered. `deliver` sends records in order; a delivered record is
removed by rewriting the file atomically (write, fsync, rename). A record that does
not parse or check (a torn last write) is moved to `<spool>.damaged`, and one the
ledger can never take to `<spool>.refused` with its answer; both are reported, never
dropped silently. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Record:
    path: str  # the API path to POST to
    body: dict[str, Any]

    def line(self) -> bytes:
        payload = json.dumps({"path": self.path, "body": self.body}, sort_keys=True)
        return json.dumps({"crc": zlib.crc32(payload.encode()), "record": payload}).encode() + b"\n"


@dataclass
class FlushReport:
    delivered: int = 0
    remaining: int = 0
    damaged: list[str] = field(default_factory=list)  # the damaged lines, as text
    refused: list[str] = field(default_factory=list)  # set aside: path and the answer
    stopped_by: str | None = None  # why delivery stopped early, if it did


@dataclass(frozen=True)
class Refused:
    """`send`'s answer for a record the ledger can never take (a 400, say): it is
    moved to `<spool>.refused` with that answer, never dropped."""

    status: int
    answer: Any


class Spool:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def append(self, record: Record) -> None:
        """Durable when it returns: the line and the directory entry are fsynced."""
        with self._locked():
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                size = os.fstat(fd).st_size
                # A torn last write has no newline: end it, so that it alone is damaged
                # and this record is not glued onto it.
                torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                os.write(fd, (b"\n" if torn else b"") + record.line())
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(self.path.parent)

    def _read(self) -> tuple[list[Record], list[str]]:
        records: list[Record] = []
        damaged: list[str] = []
        if not self.path.exists():
            return records, damaged
        for raw in self.path.read_bytes().splitlines():
            if not raw.strip():
                continue
            try:
                outer = json.loads(raw)
                payload = outer["record"]
                if zlib.crc32(payload.encode()) != outer["crc"]:
                    raise ValueError("checksum mismatch")
                inner = json.loads(payload)
                records.append(Record(inner["path"], inner["body"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                damaged.append(raw.decode("utf-8", "replace"))
        return records, damaged

    def pending(self) -> list[Record]:
        return self._read()[0]

    def holds_records(self) -> bool:
        """Whether anything is spooled, without reading it: a stat, cheap enough to ask
        after every call."""
        try:
            return self.path.stat().st_size > 0
        except FileNotFoundError:
            return False

    def deliver(
        self,
        send: Callable[[Record], str | Refused | None],
        most: int | None = None,
        until: float | None = None,
    ) -> FlushReport:
        """Send each record in order, or the first `most`, and after the first only
        before `until` (a `time.monotonic()`). `send` returns None when the ledger
        recorded the record (or had it already), `Refused` when it never will, or a
        reason to stop and keep this record and the ones after it."""
        report = FlushReport()
        with self._locked():
            records, damaged = self._read()
            if damaged:
                self._set_aside(".damaged", [line + "\n" for line in damaged])
                report.damaged = damaged
            kept: list[Record] = []
            refused: list[str] = []
            for index, record in enumerate(records):
                if index == most or (index and until is not None and time.monotonic() >= until):
                    kept = records[index:]
                    break
                answer = send(record)
                if isinstance(answer, Refused):
                    aside = {
                        "record": {"path": record.path, "body": record.body},
                        "status": answer.status,
                        "answer": answer.answer,
                    }
                    refused.append(json.dumps(aside, sort_keys=True) + "\n")
                    report.refused.append(f"{record.path}: {answer.status} {answer.answer}")
                    continue
                if answer is not None:
                    kept = records[index:]
                    report.stopped_by = answer
                    break
                report.delivered += 1
            if refused:
                self._set_aside(".refused", refused)
            self._rewrite(kept)
            report.remaining = len(kept)
        return report

    def _set_aside(self, suffix: str, lines: list[str]) -> None:
        """Append lines to `<spool><suffix>`, durably, before the spool forgets them."""
        with open(self.path.with_name(self.path.name + suffix), "a") as out:
            out.writelines(lines)
            out.flush()
            os.fsync(out.fileno())

    def _rewrite(self, records: list[Record]) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "wb") as out:
            out.writelines(record.line() for record in records)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)
        _fsync_dir(self.path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
