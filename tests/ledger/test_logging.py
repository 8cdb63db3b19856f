from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A named logger's record, as django.security writes one for a refused CSRF token,
# and an error.
PROBE = (
    "import django, logging; django.setup(); "
    "logging.getLogger('django.security.csrf').warning('probe-warning'); "
    "logging.getLogger('ledger').error('probe-error')"
)


def logged(level: str | None) -> str:
    # In a fresh interpreter: the level is read when the settings configure logging.
    env = {k: v for k, v in os.environ.items() if k != "LOG_LEVEL"}
    env["DJANGO_SETTINGS_MODULE"] = "ledger.settings"
    if level is not None:
        env["LOG_LEVEL"] = level
    return subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stderr


@pytest.mark.parametrize(
    ("level", "warning_shown"), [(None, True), ("WARNING", True), ("ERROR", False)]
)
def test_log_level_applies_to_records_from_named_loggers(
    level: str | None, warning_shown: bool
) -> None:
    output = logged(level)
    assert ("level=WARNING logger=django.security.csrf probe-warning" in output) is warning_shown
    assert "level=ERROR logger=ledger probe-error" in output
