from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_web_process_freezes_what_it_loaded_and_collects_less_often() -> None:
    # In a fresh interpreter: freezing here would change this test process's collector.
    probe = (
        "import gc, json; import ledger.wsgi; "
        "print(json.dumps([gc.get_threshold(), gc.get_freeze_count()]))"
    )
    output = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    threshold, frozen = json.loads(output.splitlines()[-1])
    assert threshold == [20_000, 20, 20]  # CPython's default is 700, 10, 10
    # Django and the project's modules (about 75,000 objects), not a handful.
    assert frozen > 50_000
