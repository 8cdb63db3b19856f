"""Settings from the environment: a value that could not work stops the ledger from
starting, and says which and why."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ledger.settings import env_named
from tests.conftest import ROOT


def check(**env: str) -> subprocess.CompletedProcess[str]:
    """`manage.py check`, as every process of the ledger starts, with `env` set."""
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        # A slice of nothing would finish every pass having verified nothing.
        ("LEDGER_VERIFY_SLICE", "0", "LEDGER_VERIFY_SLICE must be at least 1, not 0"),
        ("LEDGER_SWEEP_INTERVAL_SECONDS", "-5", "must be at least 1, not -5"),
        ("LEDGER_PROBE_BACKOFF_SECONDS", "-1", "must be at least 0, not -1"),
        ("LEDGER_VERIFY_INTERVAL_SECONDS", "soon", "must be an integer, not 'soon'"),
        ("LEDGER_ANCHOR_PROTOCOL", "xml", "must be json or rfc3161, not 'xml'"),
        # A token nothing can check proves nothing.
        ("LEDGER_ANCHOR_PROTOCOL", "rfc3161", "rfc3161 needs LEDGER_ANCHOR_TSA_ROOTS"),
    ],
)
def test_a_setting_that_could_not_work_stops_the_ledger_from_starting(
    name: str, value: str, said: str
) -> None:
    refused = check(**{name: value})
    assert refused.returncode != 0
    assert f"ImproperlyConfigured: {name} " in refused.stderr and said in refused.stderr


def test_the_smallest_working_values_start_it() -> None:
    started = check(LEDGER_VERIFY_SLICE="1", LEDGER_PROBE_BACKOFF_SECONDS="0")
    assert (started.returncode, started.stderr) == (0, "")


def test_settings_given_by_name_are_read_by_their_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """LEDGER_PROBE_CA_FILE_PAYMENTS is the CA file named PAYMENTS; the global setting,
    named as the prefix is, is not one of them, nor is a name set to nothing."""
    monkeypatch.setenv("LEDGER_PROBE_CA_FILE", "/etc/ssl/company-ca.pem")
    monkeypatch.setenv("LEDGER_PROBE_CA_FILE_PAYMENTS", "/etc/ssl/payments-ca.pem")
    monkeypatch.setenv("LEDGER_PROBE_CA_FILE_HR", "")
    assert env_named("LEDGER_PROBE_CA_FILE_") == {"PAYMENTS": "/etc/ssl/payments-ca.pem"}


# Every read of the environment by the ledger's processes: settings.py's helpers and
# os.environ. The runtime client (ledger/client) reads its own, documented with it.
ENVIRONMENT_READ = re.compile(r"(?:env_\w+|environ\.get|environ|getenv)\(?\[?\"([A-Z][A-Z0-9_]*)\"")


def test_every_setting_the_ledger_reads_is_listed_in_env_example() -> None:
    """The README sends operators to .env.example for every setting; a setting added to
    the code alone would be found only by reading it."""
    read = {
        name
        for package in ("ledger", "reconciliation")
        for path in (ROOT / package).rglob("*.py")
        if "client" not in path.relative_to(ROOT).parts
        for name in ENVIRONMENT_READ.findall(path.read_text())
    } - {"DJANGO_SETTINGS_MODULE"}
    listed = (ROOT / ".env.example").read_text()
    assert len(read) > 40
    # A setting given by name (LEDGER_PROBE_SECRET_…) is listed by an example name.
    assert [name for name in sorted(read) if name not in listed] == []


def test_each_pytest_xdist_worker_and_the_processes_it_starts_use_queues_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker process started by one pytest-xdist worker's test must not take the
    tasks another's tests send: they are on other databases, and the task is lost."""
    from tests.settings import _queue_name

    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/ledger")
    monkeypatch.delenv("LEDGER_QUEUE")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    controller = _queue_name()
    assert controller == "ledger-tests-ledger"

    def started_by(parent: str, worker: str) -> str:
        monkeypatch.setenv("LEDGER_QUEUE", parent)
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        return _queue_name()

    first, second = started_by(controller, "gw0"), started_by(controller, "gw1")
    assert (first, second) == ("ledger-tests-ledger-gw0", "ledger-tests-ledger-gw1")
    # A Celery worker a test of gw1 starts, on gw1's test database, inherits gw1's name.
    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test_ledger_gw1")
    assert started_by(second, "gw1") == second
