from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from ledger.models import Runtime, RuntimeToken
from tests.reconciliation.conftest import Workers


@pytest.fixture
def runtime_token(transactional_db: None) -> str:
    _, token = RuntimeToken.issue(runtime=Runtime.objects.create(name="conformance"))
    return token


def test_the_project_ledger_conforms(
    live_server: Any, runtime_token: str, workers: Workers, tmp_path: Path
) -> None:
    workers.start()
    workers.beat(tmp_path)
    out = io.StringIO()
    call_command("conformance", url=live_server.url, token=runtime_token, timeout=60, stdout=out)
    lines = out.getvalue().splitlines()
    assert [line.split(".")[0] for line in lines[:7]] == [f"PASS  {n}" for n in range(1, 8)]
    assert lines[-1] == "7 passed, 0 failed"


def test_a_ledger_without_reconciliation_fails_with_a_clear_message(
    live_server: Any, runtime_token: str
) -> None:
    """No Celery worker or beat: nothing ever flags or settles the invocation."""
    out = io.StringIO()
    with pytest.raises(CommandError, match="conformance failed"):
        call_command("conformance", url=live_server.url, token=runtime_token, timeout=5, stdout=out)
    report = out.getvalue()
    assert "PASS  3. outcome append fails" in report
    assert (
        "FAIL  4. distinct non-retryable failure: the ledger flagging the missing "
        "outcome (is its sweep running?) did not happen within 5s" in report
    )
    assert report.splitlines()[-1] == "3 passed, 4 failed"
