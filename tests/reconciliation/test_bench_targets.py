"""The benchmark's own arithmetic: whether a run met each of issue #2's bars, and
where the CPU went."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from reconciliation.management.commands.bench import cpu_per_operation, cpu_spent, targets


def run(*, intent: float, writes: float, batch_1: float, batch_2: float) -> dict[str, Any]:
    return {
        "ratios": {
            "intent_p50_over_raw_p50_1_client": intent,
            "api_writes_per_second_over_raw_8_clients": writes,
        },
        "batch_1": {"items_per_second": batch_1},
        "batch_2": {"items_per_second": batch_2},
    }


def verdicts(results: dict[str, Any]) -> list[bool]:
    return [target["met"] for target in targets(results)]


def test_figures_on_the_bars_meet_them() -> None:
    results = run(intent=6.0, writes=0.2, batch_1=5000, batch_2=10)
    assert verdicts(results) == [True, True, True]
    assert [target["figure"] for target in targets(results)] == [6.0, 0.2, 5000]


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        (run(intent=6.01, writes=0.2, batch_1=5000, batch_2=0), [False, True, True]),
        (run(intent=6.0, writes=0.199, batch_1=5000, batch_2=0), [True, False, True]),
        (run(intent=6.0, writes=0.2, batch_1=4999, batch_2=4999.9), [True, True, False]),
        # The batch counts from whichever client count did better.
        (run(intent=5.0, writes=0.3, batch_1=2100, batch_2=5001), [True, True, True]),
    ],
)
def test_a_figure_past_its_bar_misses_it(results: dict[str, Any], expected: list[bool]) -> None:
    assert verdicts(results) == expected


BURN = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.4: pass"


def test_the_cpu_of_a_child_that_exited_is_counted_for_its_parent() -> None:
    """So are the postmaster's reaped backends counted for PostgreSQL. The child burns
    0.4 s, checked against 0.3: /proc counts in clock ticks."""
    spent: dict[str, float] = {}
    with cpu_spent(os.getpid(), spent):
        subprocess.run([sys.executable, "-c", BURN], check=True)

    assert spent["web"] >= 0.3
    assert spent["clients"] == 0  # this process is the "web" here, counted once
    assert spent["machine"] >= 0.3


def test_cpu_per_operation_leaves_the_rest_of_the_machine_as_other() -> None:
    spent = {"web": 1.0, "postgres": 0.5, "clients": 0.25, "machine": 2.0}
    assert cpu_per_operation(spent, 1000) == {
        "web": 1.0,
        "postgres": 0.5,
        "clients": 0.25,
        "machine": 2.0,
        "other": 0.25,
    }
    # Samples a moment apart can add up to more than the machine's total.
    assert cpu_per_operation({**spent, "machine": 1.7}, 1000)["other"] == 0.0
