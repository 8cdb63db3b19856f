"""The Prometheus alerting rules shipped in docs/prometheus: valid, doing what their
unit tests say, and naming only what the ledger's /metrics serves."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

RULES = Path(__file__).resolve().parents[2] / "docs" / "prometheus"
METRIC = re.compile(r"\bledger_[a-z_]+")
# promtool comes with Debian's prometheus package; `make test` installs it.
PROMTOOL = shutil.which("promtool")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL, "promtool is not installed: `make test-tools` installs it (apt, prometheus)"
    return subprocess.run([PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=120)


def test_the_rules_are_valid_and_pass_their_unit_tests() -> None:
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_severity_and_says_what_to_do() -> None:
    rules = [rule for group in load("alerts.yml")["groups"] for rule in group["rules"]]
    assert len(rules) == 10
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_rules_and_their_tests_name_only_what_the_ledger_serves(
    db: None, client: Client
) -> None:
    """A metric renamed in ledger/metrics.py would leave an alert that never fires, and
    tests of series the ledger never sends would still pass."""
    served = {
        family.name: family
        for family in text_string_to_metric_families(client.get("/metrics").content.decode())
    }
    rules = load("alerts.yml")
    named = {
        name
        for group in rules["groups"]
        for rule in group["rules"]
        for name in METRIC.findall(rule["expr"])
    }
    assert named and named <= served.keys(), named - served.keys()
    tests = load("alerts.test.yml")["tests"]
    series = [s["series"] for test in tests for s in test["input_series"]]
    assert {METRIC.findall(s)[0] for s in series} <= served.keys()
    # The labels of each series, but the scrape's own, are those the ledger gives it
    # (as far as an empty ledger gives any: the families it always fills).
    for written in series:
        name, labels = METRIC.findall(written)[0], set(re.findall(r"(\w+)=", written))
        samples = served[name].samples
        if samples:
            assert labels - {"instance"} == set(samples[0].labels), written


def load(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((RULES / name).read_text())
    return loaded
