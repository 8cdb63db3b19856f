"""The benchmark says for each of issue #2's bars whether its run met it."""

from __future__ import annotations

from typing import Any

import pytest

from reconciliation.management.commands.bench import targets


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
