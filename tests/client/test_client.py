"""The runtime client against a live ledger (pytest's live server on PostgreSQL)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from ledger.client import (
    BusinessFailure,
    CallContext,
    LedgerClient,
    NotDispatched,
)
from ledger.models import Invocation, Outcome
from tests.client.conftest import TcpProxy
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]


class Tool:
    """A business tool that counts its calls."""

    def __init__(self, behaviour: Any = None) -> None:
        self.calls: list[CallContext] = []
        self.behaviour = behaviour

    def __call__(self, context: CallContext) -> Any:
        self.calls.append(context)
        if isinstance(self.behaviour, BaseException):
            raise self.behaviour
        if callable(self.behaviour):
            return self.behaviour(context)
        return {"id": f"RF-{len(self.calls)}"}


def invoke(client: LedgerClient, tool: Tool, key: str = "refund-SO-1", **kw: Any) -> Any:
    return client.invoke(
        task_id="task-1", capability="refund.create", arguments={"order": "SO-1"},
        idempotency_key=key, call=tool, reference=lambda v: v["id"], **kw,
    )  # fmt: skip


def test_a_success_is_recorded_with_its_reference(live_server: Any, token: str) -> None:
    client = LedgerClient(live_server.url, token)
    tool = Tool()
    result = invoke(client, tool)
    assert (result.kind, result.status, result.next_action) == ("succeeded", "succeeded", "none")
    assert (result.value, result.business_reference) == ({"id": "RF-1"}, "RF-1")
    assert tool.calls[0].idempotency_key == "refund-SO-1"
    assert Outcome.objects.get().business_reference == "RF-1"


def test_a_business_refusal_is_business_failed(live_server: Any, token: str) -> None:
    client = LedgerClient(live_server.url, token)
    result = invoke(client, Tool(BusinessFailure("limit_exceeded", "over the refund limit")))
    assert (result.kind, result.status, result.retryable) == ("business_failed", "failed", False)
    assert Outcome.objects.get().error_code == "limit_exceeded"


def test_a_retryable_business_failure_is_retried_under_the_same_key(
    live_server: Any, token: str
) -> None:
    client = LedgerClient(live_server.url, token)
    first = invoke(client, Tool(BusinessFailure("busy", retryable=True)))
    assert (first.kind, first.retryable, first.next_action) == ("business_failed", True, "retry")
    tool = Tool()
    second = client.retry(first.invocation_id, tool, reference=lambda v: v["id"])
    assert (second.kind, second.attempt_id) == ("succeeded", "a2")
    assert tool.calls[0].idempotency_key == "refund-SO-1"


def test_an_unknown_failure_after_dispatch_is_never_retried_blindly(
    live_server: Any, token: str
) -> None:
    client = LedgerClient(live_server.url, token)
    result = invoke(client, Tool(TimeoutError("no answer from payments")))
    assert result.kind == "post_dispatch_evidence_failed"
    assert (result.retryable, result.reconciliation_required) == (False, True)
    assert result.next_action == "reconcile"
    tool = Tool()
    refused = client.retry(result.invocation_id, tool)
    assert (refused.kind, refused.reconciliation_required) == ("attempt_refused", True)
    assert tool.calls == []  # refused locally: the tool was never called again


def test_a_tool_that_never_sent_anything_is_pre_dispatch_rejected(
    live_server: Any, token: str
) -> None:
    client = LedgerClient(live_server.url, token)
    result = invoke(client, Tool(NotDispatched("validation failed locally")))
    assert (result.kind, result.status, result.retryable) == (
        "pre_dispatch_rejected",
        "retry_allowed",
        True,
    )


def test_no_intent_means_no_call(token: str) -> None:
    client = LedgerClient("http://127.0.0.1:9", token, retries=1)
    tool = Tool()
    result = invoke(client, tool)
    assert (result.kind, result.retryable) == ("pre_dispatch_rejected", True)
    assert tool.calls == []
    assert not Invocation.objects.exists()


def test_a_ledger_down_between_dispatch_and_outcome_spools_and_delivers_once(
    proxy: TcpProxy, token: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool.jsonl"
    client = LedgerClient(proxy.url, token, spool=str(spool), retries=1)

    def refund_then_ledger_dies(context: CallContext) -> dict[str, str]:
        proxy.stop()
        return {"id": "RF-9"}

    result = invoke(client, Tool(refund_then_ledger_dies))
    assert result.kind == "post_dispatch_evidence_failed"
    assert (result.value, result.reconciliation_required) == ({"id": "RF-9"}, True)
    assert "kept in the spool" in result.error
    assert len(client.spool.pending()) == 1  # type: ignore[union-attr]
    assert not Outcome.objects.exists()
    proxy.start()
    report = client.flush()
    assert (report.delivered, report.remaining, report.damaged) == (1, 0, [])
    assert client.flush().delivered == 0
    outcome = Outcome.objects.get()
    assert (outcome.kind, outcome.business_reference) == ("succeeded", "RF-9")
    assert Invocation.objects.get().status == "succeeded"


RUNTIME_SCRIPT = """
import sys, time
from pathlib import Path
from ledger.client import LedgerClient
url, token, spool, marker = sys.argv[1:5]
client = LedgerClient(url, token, spool=spool, retries=1)
def refund(context):
    Path(marker).write_text("dispatched")
    while Path(marker).read_text() != "ledger is down":
        time.sleep(0.05)
    return {"id": "RF-crash"}
result = client.invoke(task_id="t", capability="refund.create", arguments={},
                       idempotency_key="k-crash", call=refund, reference=lambda v: v["id"])
Path(marker).write_text("spooled " + result.kind)
time.sleep(600)  # killed here
"""


def test_a_runtime_killed_after_dispatch_still_delivers_from_its_spool(
    proxy: TcpProxy, token: str, tmp_path: Path
) -> None:
    spool, marker = tmp_path / "spool.jsonl", tmp_path / "marker"
    marker.write_text("")
    runtime = subprocess.Popen(
        [sys.executable, "-c", RUNTIME_SCRIPT, proxy.url, token, str(spool), str(marker)],
        cwd=ROOT,
    )
    try:
        wait_for(lambda: marker.read_text() == "dispatched", seconds=20)
        proxy.stop()
        marker.write_text("ledger is down")
        wait_for(lambda: marker.read_text().startswith("spooled"), seconds=20)
        assert marker.read_text() == "spooled post_dispatch_evidence_failed"
    finally:
        runtime.send_signal(signal.SIGKILL)
        runtime.wait()
    proxy.start()
    flush = subprocess.run(
        [sys.executable, "-m", "ledger.client", "flush", str(spool), "--url", proxy.url,
         "--token", token],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert flush.returncode == 0, flush.stdout + flush.stderr
    assert "delivered 1, remaining 0" in flush.stdout
    assert Outcome.objects.get().business_reference == "RF-crash"


def test_a_torn_spool_delivers_the_intact_records_and_reports_the_damaged_one(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool.jsonl"
    online = LedgerClient(live_server.url, token, spool=str(spool))
    offline = LedgerClient("http://127.0.0.1:9", token, spool=str(spool), retries=0)
    for n in (1, 2):
        intent = {
            "invocation_id": f"inv-{n}", "task_id": "t", "capability": "refund.create",
            "arguments": {}, "idempotency_key": f"k-{n}", "attempt_id": "a1",
        }  # fmt: skip
        assert online._request("POST", "/api/v1/intents", intent)[0] == 201
        # The tool ran; the ledger was gone when its outcome was reported.
        context = CallContext(f"inv-{n}", "a1", f"k-{n}")
        result = offline._dispatch(context, "t", Tool(), lambda v: v["id"])
        assert result.kind == "post_dispatch_evidence_failed"
    lines = spool.read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    spool.write_bytes(lines[0] + lines[1][: len(lines[1]) // 2])  # the last write was torn
    report = online.flush()
    assert (report.delivered, report.remaining, len(report.damaged)) == (1, 0, 1)
    assert Path(str(spool) + ".damaged").read_text().strip() == report.damaged[0]
    outcomes = Outcome.objects.values_list("attempt__invocation__invocation_id", flat=True)
    assert list(outcomes) == ["inv-1"]


def test_the_client_works_in_a_venv_with_only_httpx(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    uv = [shutil.which("uv") or "uv"]  # `make` installs uv before any test runs
    subprocess.run([*uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [*uv, "pip", "install", "-q", "--python", str(python), "httpx==0.28.1"], check=True
    )
    package = tmp_path / "src" / "ledger"
    shutil.copytree(ROOT / "ledger" / "client", package / "client")
    (package / "__init__.py").write_text("")
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        assert importlib.util.find_spec("django") is None, "django must not be here"
        from ledger.client import LedgerClient
        client = LedgerClient({live_server.url!r}, {token!r})
        result = client.invoke(task_id="t", capability="refund.create", arguments={{"a": 1}},
                               idempotency_key="venv-key", call=lambda ctx: {{"id": "RF-v"}},
                               reference=lambda v: v["id"])
        print(result.kind, result.business_reference)
        """
    )
    run = subprocess.run(
        [str(python), "-c", script], env={"PYTHONPATH": str(tmp_path / "src")},
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "succeeded RF-v"


def test_a_tool_that_cannot_tell_whether_it_sent_is_dispatch_not_established(
    live_server: Any, token: str
) -> None:
    from ledger.client import DispatchNotEstablished

    client = LedgerClient(live_server.url, token)
    result = invoke(client, Tool(DispatchNotEstablished("socket closed while sending")))
    # refund.create's key is not verified as enforced: this needs reconciliation.
    assert (result.kind, result.status, result.retryable) == (
        "dispatch_not_established",
        "reconciliation_required",
        False,
    )


def test_a_second_attempt_while_one_is_in_flight_is_refused_locally(
    live_server: Any, token: str
) -> None:
    client = LedgerClient(live_server.url, token)
    inner_tool = Tool()
    seen: list[Any] = []

    def tool_that_retries_itself(context: CallContext) -> dict[str, str]:
        seen.append(client.retry(context.invocation_id, inner_tool))
        return {"id": "RF-1"}

    result = invoke(client, Tool(tool_that_retries_itself))
    assert result.kind == "succeeded"
    assert (seen[0].kind, seen[0].status) == ("attempt_in_flight", "in_flight")
    assert inner_tool.calls == []
