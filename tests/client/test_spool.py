"""The spool on its own: what a crash mid-write leaves, and what comes after it."""

from __future__ import annotations

import time
from pathlib import Path

from ledger.client.spool import Record, Spool


def outcome(n: int) -> Record:
    return Record(f"/api/v1/invocations/inv-{n}/attempts/a1/outcome", {"kind": "succeeded"})


def test_a_record_appended_after_a_torn_write_is_intact(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    spool.append(outcome(1))
    torn = spool.path.read_bytes()
    spool.path.write_bytes(torn[: len(torn) // 2])  # the process died mid-write
    spool.append(outcome(2))  # after the restart

    sent: list[Record] = []
    report = spool.deliver(lambda record: sent.append(record))
    assert sent == [outcome(2)]
    assert (report.delivered, report.remaining, len(report.damaged)) == (1, 0, 1)
    assert report.damaged[0].encode() == torn[: len(torn) // 2]


def test_undelivered_records_stay_in_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    for n in (1, 2, 3):
        spool.append(outcome(n))
    sent: list[Record] = []

    def ledger_down_at_the_second(record: Record) -> str | None:
        if record == outcome(2):
            return "ledger down"
        sent.append(record)
        return None

    report = spool.deliver(ledger_down_at_the_second)
    assert (sent, report.stopped_by, report.remaining) == ([outcome(1)], "ledger down", 2)
    assert spool.pending() == [outcome(2), outcome(3)]


def test_a_delivery_begins_no_record_after_its_time_but_always_the_first(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    for n in (1, 2, 3):
        spool.append(outcome(n))
    sent: list[Record] = []
    report = spool.deliver(lambda record: sent.append(record), until=time.monotonic() - 1)
    assert (sent, report.delivered, report.remaining, report.stopped_by) == (
        [outcome(1)], 1, 2, None,
    )  # fmt: skip
    assert spool.pending() == [outcome(2), outcome(3)]
    report = spool.deliver(lambda record: sent.append(record), until=time.monotonic() + 60)
    assert (report.delivered, report.remaining) == (2, 0)
    assert sent == [outcome(1), outcome(2), outcome(3)]
