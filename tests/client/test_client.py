"""The runtime client against a live ledger (pytest's live server on PostgreSQL)."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import decimal
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import connection

from ledger import acc
from ledger.capabilities import capability_register, capability_settings_change
from ledger.client import (
    BusinessFailure,
    CallContext,
    LedgerClient,
    LedgerRequestError,
    NotDispatched,
)
from ledger.client.spool import Record, Spool
from ledger.models import Invocation, Outcome, Runtime, RuntimeToken
from tests.client.conftest import SlowDeliveries, TcpProxy
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


def test_the_subject_and_approval_evidence_go_with_the_intent(live_server: Any, token: str) -> None:
    """A capability that names its subject and asks for approval (payroll changes,
    say): without a subject the intent is refused before the tool is called; without
    approval evidence it is recorded, flagged `approval_missing`; with both, kept."""
    declaration = {
        "version": 1, "enabled": True, "scope": "refund.create", "risk": {"level": "high"},
        "subject": {"required": True}, "approval": {"required": True},
    }  # fmt: skip
    capability_register(declaration=acc.parse(declaration), source="tests", actor="user:tests")
    client = LedgerClient(live_server.url, token)
    tool = Tool()
    with pytest.raises(LedgerRequestError) as refused:
        invoke(client, tool, key="k-1")
    assert (refused.value.status, refused.value.type) == (422, "subject_required")
    assert tool.calls == [] and not Invocation.objects.exists()

    unapproved = invoke(client, tool, key="k-2", subject="employee:e-17")
    assert (unapproved.kind, unapproved.flags) == ("succeeded", ["approval_missing"])

    approval = {"approved_by": "manager:ann", "ticket": "CHG-7"}
    approved = invoke(client, tool, key="k-3", subject="employee:e-17", approval=approval)
    assert (approved.kind, approved.flags) == ("succeeded", [])
    invocation = Invocation.objects.get(invocation_id=approved.invocation_id)
    assert (invocation.subject, invocation.approval) == ("employee:e-17", approval)
    assert len(tool.calls) == 2


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_answer_trace_and_runtime_clock_are_kept_as_evidence(
    live_server: Any, token: str
) -> None:
    client = LedgerClient(live_server.url, token)
    before = dt.datetime.now(dt.UTC)
    result = client.invoke(
        task_id="task-1", capability="refund.create", arguments={"order": "SO-1"},
        idempotency_key="refund-SO-1", call=Tool(), traceparent=TRACEPARENT,
        reference=lambda v: v["id"], result=lambda v: {**v, "amount": "12.50"},
    )  # fmt: skip
    assert result.kind == "succeeded"
    outcome = Outcome.objects.select_related("attempt__invocation").get()
    assert outcome.result == {"id": "RF-1", "amount": "12.50"}
    assert outcome.result_digest.startswith("sha256:")
    invocation = outcome.attempt.invocation
    assert invocation.traceparent == TRACEPARENT
    assert invocation.requested_at is not None
    assert before <= invocation.requested_at <= invocation.created_at


def test_an_answer_that_is_not_json_is_told_as_missing_evidence(
    live_server: Any, token: str
) -> None:
    """The refund was made; what it answered cannot be recorded: the caller is told the
    evidence failed, never to retry, and the ledger reconciles it by its key."""
    client = LedgerClient(live_server.url, token)
    tool = Tool()
    result = invoke(client, tool, result=lambda v: {"amount": decimal.Decimal("12.50")})
    assert len(tool.calls) == 1
    assert (result.kind, result.retryable, result.reconciliation_required) == (
        "post_dispatch_evidence_failed",
        False,
        True,
    )
    assert "Decimal is not JSON serializable" in result.error
    assert Outcome.objects.get().error_code == "TypeError"


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
        assert online.request("POST", "/api/v1/intents", intent)[0] == 201
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

        import asyncio
        from ledger.client import AsyncLedgerClient
        async def refund(ctx):
            return {{"id": "RF-async"}}
        async def main():
            async with AsyncLedgerClient({live_server.url!r}, {token!r}) as client:
                return await client.invoke(
                    task_id="t", capability="refund.create", arguments={{"a": 2}},
                    idempotency_key="venv-async-key", call=refund, reference=lambda v: v["id"],
                )
        result = asyncio.run(main())
        print(result.kind, result.business_reference)
        """
    )
    run = subprocess.run(
        [str(python), "-c", script], env={"PYTHONPATH": str(tmp_path / "src")},
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["succeeded RF-v", "succeeded RF-async"]


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


INTERRUPTED_SCRIPT = """
import signal, sys, time
import httpx
from pathlib import Path
from ledger.client import LedgerClient
url, token, spool, marker, outcome_delay = sys.argv[1:6]
class SlowOutcomes(httpx.HTTPTransport):
    def handle_request(self, request):
        if request.url.path.endswith("/outcome"):
            time.sleep(float(outcome_delay))  # a ledger slow to answer, as under load
        return super().handle_request(request)
def refund(context):
    Path(marker).write_text("dispatched")
    signal.pause()  # the payments system never answers, until the operator presses Ctrl-C
LedgerClient(url, token, spool=spool or None, transport=SlowOutcomes()).invoke(
    task_id="t", capability="refund.create", arguments={}, idempotency_key="k-int", call=refund
)
"""


def interrupt_runtime_mid_call(
    url: str, token: str, spool: str, tmp_path: Path, outcome_delay: float = 0
) -> str:
    """A runtime process, its tool waiting on the business system, sent SIGINT (Ctrl-C):
    what it printed as it stopped. Its client is never closed, as in most scripts."""
    marker = tmp_path / "marker"
    marker.write_text("")
    runtime = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_SCRIPT, url, token, spool, str(marker),
         str(outcome_delay)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: marker.read_text() == "dispatched", seconds=20)
        runtime.send_signal(signal.SIGINT)
        _, stderr = runtime.communicate(timeout=20)
    finally:
        runtime.kill()
    return stderr


def assert_recorded_as_interrupted() -> None:
    outcome = Outcome.objects.get()
    assert (outcome.kind, outcome.error_code) == (
        "post_dispatch_evidence_failed",
        "KeyboardInterrupt",
    )
    assert "stopped waiting for the tool" in outcome.error_message
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.cause) == (
        "reconciliation_required",
        "evidence_reported_lost",
    )


def test_a_call_interrupted_by_ctrl_c_is_told_to_the_ledger_as_the_runtime_exits(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    """SIGINT while the tool waits on the business system: the runtime stops, and
    before its process exits, the ledger has learnt that the call's effect is unknown
    and why, instead of flagging the attempt at its deadline. The exit waits for that
    answer even when it is slow (here 1 s; the client's timeout is 5)."""
    stderr = interrupt_runtime_mid_call(live_server.url, token, "", tmp_path, outcome_delay=1)
    assert "KeyboardInterrupt" in stderr
    assert_recorded_as_interrupted()


def test_a_call_interrupted_by_ctrl_c_is_kept_in_the_spool_as_well(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    """With a spool, what the interrupted call told the ledger is kept there too, in
    case that send was lost; the next flush delivers it again, harmlessly."""
    spool = tmp_path / "spool.jsonl"
    stderr = interrupt_runtime_mid_call(live_server.url, token, str(spool), tmp_path)
    assert "KeyboardInterrupt" in stderr
    assert_recorded_as_interrupted()
    report = LedgerClient(live_server.url, token, spool=str(spool)).flush()
    assert (report.delivered, report.remaining) == (1, 0)
    assert Outcome.objects.count() == 1


class StallsOutcomes(httpx.HTTPTransport):
    """The ledger does not answer an outcome report, as behind a stalled proxy, until
    the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/outcome"):
            self.release.wait(timeout=60)
        return super().handle_request(request)


def test_closing_a_client_gives_an_interrupted_calls_outcome_one_requests_time(
    live_server: Any, token: str
) -> None:
    """The outcome of an interrupted call stalls on its way: `close` (and so the
    process's exit) waits for it one request's time, then gives it up, so a stalled
    ledger never holds a stopped runtime. Released later, it is still recorded."""
    stalled = StallsOutcomes()
    with LedgerClient(live_server.url, token, transport=stalled, timeout=0.5) as client:
        with pytest.raises(KeyboardInterrupt):
            invoke(client, Tool(KeyboardInterrupt()))
        [sending] = client._leaving
    assert sending.is_alive()  # closed while the send still waited on the ledger
    stalled.release.set()
    sending.join(timeout=20)
    assert Outcome.objects.get().error_code == "KeyboardInterrupt"


def test_an_interrupted_calls_outcome_lost_on_its_way_is_logged(
    live_server: Any, token: str, caplog: pytest.LogCaptureFixture
) -> None:
    refuses_outcomes = InterposedTransport(refuse_outcome_reports)
    with (
        LedgerClient(live_server.url, token, transport=refuses_outcomes, retries=0) as client,
        pytest.raises(KeyboardInterrupt),
    ):
        invoke(client, Tool(KeyboardInterrupt()))
    assert not Outcome.objects.exists()
    warnings = [r.getMessage() for r in caplog.records if r.name == "ledger.client"]
    assert len(warnings) == 1
    assert warnings[0].startswith("outcome of an abandoned call not recorded (no spool configured)")


def test_an_attempt_admitted_before_is_never_called_again(live_server: Any, token: str) -> None:
    """A runtime that died after dispatch and re-invokes under the same invocation_id
    gets a replayed admission (200): the tool may have run, so it is not called again."""
    # The process dies after dispatch, its outcome never sent.
    with LedgerClient(
        live_server.url, token, transport=InterposedTransport(refuse_outcome_reports), retries=0
    ) as dying:
        crashed = Tool(KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            invoke(dying, crashed, invocation_id="inv-restarted")
    assert len(crashed.calls) == 1

    client = LedgerClient(live_server.url, token)
    tool = Tool()
    again = invoke(client, tool, invocation_id="inv-restarted")
    assert tool.calls == []
    assert (again.kind, again.status, again.next_action) == (
        "attempt_in_flight",
        "in_flight",
        "await_outcome",
    )
    assert "admitted before" in again.error
    assert Invocation.objects.get().attempts.count() == 1


class InterposedTransport(httpx.HTTPTransport):
    """Lets a test act before chosen requests reach the ledger, or answer in its place."""

    def __init__(self, interpose: Callable[[httpx.Request], httpx.Response | None]) -> None:
        super().__init__()
        self.interpose = interpose

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.interpose(request)
        return answer if answer is not None else super().handle_request(request)


def refuse_outcome_reports(request: httpx.Request) -> None:
    """The ledger cannot be reached for outcome reports; every other request goes to it."""
    if request.url.path.endswith("/outcome"):
        raise httpx.ConnectError("connection refused", request=request)


def test_of_two_processes_retrying_at_once_only_the_admitted_one_calls(
    live_server: Any, token: str
) -> None:
    first = invoke(
        LedgerClient(live_server.url, token), Tool(BusinessFailure("busy", retryable=True))
    )
    path = f"/api/v1/invocations/{first.invocation_id}/attempts"
    other_process = LedgerClient(live_server.url, token)
    admitted: list[tuple[int, Any]] = []

    def other_process_first(request: httpx.Request) -> None:
        # Between this client's read of the attempts and its own admission request, the
        # other process is admitted under the same next attempt id and calls the tool.
        if request.url.path == path and not admitted:
            admitted.append(other_process.request("POST", path, {"attempt_id": "a2"}))

    racing = LedgerClient(
        live_server.url, token, transport=InterposedTransport(other_process_first)
    )
    tool = Tool()
    lost = racing.retry(first.invocation_id, tool)
    assert admitted[0][0] == 201
    assert tool.calls == []
    assert (lost.kind, lost.attempt_id, lost.status) == ("attempt_in_flight", "a2", "in_flight")


def test_a_proxy_error_page_instead_of_the_outcome_answer_spools_the_outcome(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    """A load balancer's 502 page is no answer from the ledger: after dispatch, that is
    post_dispatch_evidence_failed with the outcome spooled, never a decoding crash."""
    bad_gateway = httpx.Response(502, headers={"content-type": "text/html"}, text="<h1>502</h1>")
    client = LedgerClient(
        live_server.url,
        token,
        spool=str(tmp_path / "spool.jsonl"),
        retries=1,
        transport=InterposedTransport(
            lambda request: bad_gateway if request.url.path.endswith("/outcome") else None
        ),
    )
    tool = Tool()
    result = invoke(client, tool)
    assert len(tool.calls) == 1
    assert (result.kind, result.reconciliation_required) == ("post_dispatch_evidence_failed", True)
    assert "502 without an answer from the ledger" in result.error
    assert "kept in the spool" in result.error
    assert not Outcome.objects.exists()

    report = LedgerClient(live_server.url, token, spool=str(tmp_path / "spool.jsonl")).flush()
    assert (report.delivered, report.remaining) == (1, 0)
    assert Outcome.objects.get().kind == "succeeded"


def test_an_outcome_the_ledger_fails_to_record_is_resent_then_spooled_never_dropped(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    """A typed 500 (here `projection_broken`: the row was edited while the tool ran) is
    resent like a 503, then kept in the spool until the ledger can take it."""

    def row_edited_meanwhile(context: CallContext) -> dict[str, str]:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE ledger_invocation SET event_count = 1")
        return {"id": "RF-1"}

    statuses: list[int] = []
    client = LedgerClient(live_server.url, token, spool=str(tmp_path / "spool.jsonl"), retries=1)
    client.http.event_hooks["response"].append(lambda r: statuses.append(r.status_code))
    tool = Tool(row_edited_meanwhile)
    result = invoke(client, tool)
    assert statuses == [201, 500, 500]
    assert len(tool.calls) == 1
    assert (result.kind, result.reconciliation_required) == ("post_dispatch_evidence_failed", True)
    assert "outcome not recorded (projection_broken); kept in the spool" in result.error
    assert not Outcome.objects.exists()

    User.objects.create_user("ada").groups.add(Group.objects.get_or_create(name="admin")[0])
    call_command("restore_projection", result.invocation_id, "--by", "ada", "--reason", "x")
    report = client.flush()
    assert (report.delivered, report.remaining) == (1, 0)
    assert Outcome.objects.get().business_reference == "RF-1"


def test_a_rate_limited_outcome_is_sent_again_after_retry_after(
    live_server: Any, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ledger.api import throttling

    # One request a second: the intent spends it, and the outcome is refused (429).
    monkeypatch.setattr(throttling.RuntimeTokenThrottle, "rate", "1/s")
    throttling.RuntimeTokenThrottle.reset()
    statuses: list[int] = []
    client = LedgerClient(live_server.url, token)
    client.http.event_hooks["response"].append(
        lambda response: statuses.append(response.status_code)
    )
    tool = Tool()
    result = invoke(client, tool)
    throttling.RuntimeTokenThrottle.reset()
    assert statuses == [201, 429, 201]
    assert (result.kind, result.status) == ("succeeded", "succeeded")
    assert len(tool.calls) == 1
    assert Outcome.objects.get().kind == "succeeded"


def test_a_capabilitys_enforced_rate_limit_is_told_at_once_and_nothing_is_called(
    live_server: Any, token: str
) -> None:
    """One refund an hour, enforced: the second is refused before its tool is called,
    at once (the ledger asks for most of an hour, longer than the client ever waits),
    and may be tried again later under the same invocation."""
    capability_register(
        declaration=acc.parse({
            "version": 1, "enabled": True, "scope": "refund.create",
            "execution": {"rate_limit": {"count": 1, "window": "1h"}},
        }),
        source="tests", actor="user:tests",
    )  # fmt: skip
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="1 an hour", rate_limit_enforced=True
    )
    statuses: list[int] = []
    client = LedgerClient(live_server.url, token)
    client.http.event_hooks["response"].append(
        lambda response: statuses.append(response.status_code)
    )
    assert invoke(client, Tool(), key="k-1").kind == "succeeded"
    tool = Tool()
    refused = invoke(client, tool, key="k-2")
    assert statuses == [201, 201, 429]  # the second intent sent once, never resent
    assert (refused.kind, refused.retryable, refused.next_action) == (
        "pre_dispatch_rejected",
        True,
        "retry",
    )
    assert refused.error.startswith("intent not confirmed: rate_limited: retry after ")
    assert tool.calls == [] and Invocation.objects.count() == 1


def test_after_the_ledger_was_down_a_retry_sends_the_intent_again(
    proxy: TcpProxy, token: str
) -> None:
    client = LedgerClient(proxy.url, token, retries=0)
    proxy.stop()
    tool = Tool()
    down = invoke(client, tool)
    assert (down.kind, down.retryable, down.next_action) == ("pre_dispatch_rejected", True, "retry")
    assert tool.calls == [] and not Invocation.objects.exists()
    proxy.start()
    done = client.retry(down.invocation_id, tool, reference=lambda v: v["id"])
    assert (done.kind, done.attempt_id, done.business_reference) == ("succeeded", "a1", "RF-1")
    assert len(tool.calls) == 1
    assert Invocation.objects.get().invocation_id == down.invocation_id


class LosesAdmissionAnswers(httpx.HTTPTransport):
    """The ledger admits the attempt, and its answer never comes back."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method == "POST" and request.url.path.endswith("/attempts"):
            response.close()
            raise httpx.RemoteProtocolError("closed without an answer", request=request)
        return response


def test_a_retry_whose_admission_went_unanswered_never_calls_the_tool_for_it(
    live_server: Any, token: str
) -> None:
    """Its resends used up, the caller is told nothing was dispatched, which is true: the
    tool was not called. The next retry asks for the attempt after the one admitted
    unseen, which the ledger refuses while that one awaits its outcome, so no tool is
    ever called for an attempt whose admission the client did not see."""
    client = LedgerClient(live_server.url, token)
    first = invoke(client, Tool(BusinessFailure("busy", retryable=True)))
    assert (first.kind, first.retryable) == ("business_failed", True)
    tool = Tool()
    unanswered = LedgerClient(live_server.url, token, retries=0, transport=LosesAdmissionAnswers())
    lost = unanswered.retry(first.invocation_id, tool)
    assert (lost.kind, lost.next_action) == ("pre_dispatch_rejected", "retry")
    assert lost.error.startswith("attempt not confirmed: connection closed before the answer")
    attempts = Invocation.objects.get().attempts.values_list("attempt_id", flat=True)
    assert sorted(attempts) == ["a1", "a2"]
    refused = client.retry(first.invocation_id, tool)
    assert (refused.kind, refused.attempt_id, refused.status) == (
        "attempt_in_flight",
        "a3",
        "in_flight",
    )
    assert tool.calls == []
    assert Invocation.objects.get().attempts.count() == 2


def test_an_outcome_whose_answer_is_cut_off_is_sent_again_and_answered(
    proxy: TcpProxy, token: str, tmp_path: Path
) -> None:
    """The ledger recorded the outcome, and the connection closed before its answer (a
    web process killed between the two): sent again, the outcome is answered as a
    replay, so the caller learns the refund is recorded, and nothing waits in the
    spool. Before, it was told the evidence was missing, to reconcile."""
    spool = tmp_path / "spool.jsonl"
    client = LedgerClient(proxy.url, token, spool=str(spool))

    def refund_then_lose_the_outcomes_answer(context: CallContext) -> dict[str, str]:
        proxy.cut_next_answer()
        return {"id": "RF-1"}

    tool = Tool(refund_then_lose_the_outcomes_answer)
    result = invoke(client, tool)
    assert proxy.answers_cut == 1
    assert (result.kind, result.status, result.reconciliation_required) == (
        "succeeded",
        "succeeded",
        False,
    )
    assert len(tool.calls) == 1
    assert Outcome.objects.get().business_reference == "RF-1"
    report = client.flush()
    assert (report.delivered, report.remaining) == (0, 0)


def test_an_intent_whose_answer_is_cut_off_is_sent_again_and_never_dispatched(
    proxy: TcpProxy, token: str
) -> None:
    """Sent again, the intent that was recorded comes back as a replay of its admission:
    the client cannot tell whether another process called the tool for it, so it does
    not, and the ledger reconciles the attempt if no outcome comes."""
    client = LedgerClient(proxy.url, token)
    proxy.cut_next_answer()
    tool = Tool()
    result = invoke(client, tool)
    assert proxy.answers_cut == 1
    assert tool.calls == []
    assert (result.kind, result.status, result.next_action) == (
        "attempt_in_flight",
        "in_flight",
        "await_outcome",
    )
    assert Invocation.objects.get().attempt_count == 1


def test_an_intent_recorded_but_unanswered_is_not_dispatched_on_retry(
    live_server: Any, token: str
) -> None:
    """The answer admitting a1 was lost: the client cannot tell whether it called the
    tool, so a1 is left to reconciliation rather than called (perhaps) twice."""
    courier = LedgerClient(live_server.url, token)

    def record_then_lose_the_answer(request: httpx.Request) -> None:
        if request.url.path == "/api/v1/intents" and not Invocation.objects.exists():
            courier.request("POST", "/api/v1/intents", json.loads(request.content))
            raise httpx.ReadTimeout("the answer never came", request=request)

    client = LedgerClient(
        live_server.url, token, transport=InterposedTransport(record_then_lose_the_answer)
    )
    tool = Tool()
    lost = invoke(client, tool)
    assert (lost.kind, lost.retryable) == ("pre_dispatch_rejected", True)
    again = client.retry(lost.invocation_id, tool)
    assert tool.calls == []
    assert (again.kind, again.status, again.next_action) == (
        "attempt_in_flight",
        "in_flight",
        "await_outcome",
    )


def spooled_outcome(live_server: Any, token: str, spool: Path) -> None:
    """A refund made while the ledger was unreachable for its outcome: one spooled record."""
    online = LedgerClient(live_server.url, token)
    intent = {
        "invocation_id": "inv-spooled", "task_id": "t", "capability": "refund.create",
        "arguments": {}, "idempotency_key": "k-spooled", "attempt_id": "a1",
    }  # fmt: skip
    assert online.request("POST", "/api/v1/intents", intent)[0] == 201
    offline = LedgerClient("http://127.0.0.1:9", token, spool=str(spool), retries=0)
    context = CallContext("inv-spooled", "a1", "k-spooled")
    assert offline._dispatch(context, "t", Tool(), lambda v: v["id"]).kind == (
        "post_dispatch_evidence_failed"
    )
    assert len(Spool(spool).pending()) == 1


def test_a_flush_with_a_token_the_ledger_refuses_keeps_every_record(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool.jsonl"
    spooled_outcome(live_server, token, spool)
    revoked = RuntimeToken.objects.get()
    assert revoked.revoke(actor="admin:test")
    report = LedgerClient(live_server.url, token, spool=str(spool)).flush()
    assert (report.delivered, report.remaining, report.refused) == (0, 1, [])
    assert report.stopped_by is not None and "401" in report.stopped_by

    other_runtime = Runtime.objects.create(name="another-runtime")
    _, wrong_token = RuntimeToken.issue(runtime=other_runtime)
    report = LedgerClient(live_server.url, wrong_token, spool=str(spool)).flush()
    assert (report.delivered, report.remaining) == (0, 1)
    assert report.stopped_by is not None and "404" in report.stopped_by

    _, fresh = RuntimeToken.issue(runtime=revoked.runtime)
    report = LedgerClient(live_server.url, fresh, spool=str(spool)).flush()
    assert (report.delivered, report.remaining) == (1, 0)
    assert Outcome.objects.get().kind == "succeeded"


def test_a_record_the_ledger_can_never_take_is_set_aside_with_its_answer(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    spooled_outcome(live_server, token, spool.path)
    spool.append(Record("/api/v1/invocations/inv-spooled/attempts/a1/outcome", {"kind": "won"}))
    report = LedgerClient(live_server.url, token, spool=str(spool.path)).flush()
    assert (report.delivered, report.remaining, len(report.refused)) == (1, 0, 1)
    assert "400 validation_failed" in report.refused[0]
    aside = [
        json.loads(line) for line in (tmp_path / "spool.jsonl.refused").read_text().splitlines()
    ]
    assert [(r["record"]["body"], r["status"]) for r in aside] == [({"kind": "won"}, 400)]


def test_an_outcome_refused_for_a_token_revoked_mid_call_is_spooled_for_the_new_one(
    live_server: Any, token: str, tmp_path: Path
) -> None:
    """The token is rotated while the refund is being made: the outcome is not lost
    with an exception, it waits in the spool for a flush with the new token."""
    spool = str(tmp_path / "spool.jsonl")
    old = RuntimeToken.objects.get()
    new: list[str] = []

    def refund_during_rotation(context: CallContext) -> dict[str, str]:
        assert old.revoke(actor="admin:rotation")
        new.append(RuntimeToken.issue(runtime=old.runtime)[1])
        return {"id": "RF-rotated"}

    result = invoke(LedgerClient(live_server.url, token, spool=spool), Tool(refund_during_rotation))
    assert (result.kind, result.reconciliation_required) == ("post_dispatch_evidence_failed", True)
    assert "refused for this client (401 unauthenticated); kept in the spool" in result.error
    report = LedgerClient(live_server.url, new[0], spool=spool).flush()
    assert (report.delivered, report.remaining) == (1, 0)
    assert Outcome.objects.get().business_reference == "RF-rotated"


def test_the_next_call_the_ledger_answers_delivers_what_the_spool_holds(
    live_server: Any, token: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A runtime that never calls flush: its spooled outcome goes with its next call
    the ledger answers (unless it turned `auto_flush` off)."""
    spool = tmp_path / "spool.jsonl"
    spooled_outcome(live_server, token, spool)
    manual = LedgerClient(live_server.url, token, spool=str(spool), auto_flush=False)
    assert invoke(manual, Tool(), key="k-manual").kind == "succeeded"
    assert len(Spool(spool).pending()) == 1
    caplog.set_level("INFO", logger="ledger.client")
    automatic = LedgerClient(live_server.url, token, spool=str(spool))
    assert invoke(automatic, Tool(), key="k-automatic").kind == "succeeded"
    assert Spool(spool).pending() == []
    delivered = Outcome.objects.get(attempt__invocation__invocation_id="inv-spooled")
    assert (delivered.kind, delivered.business_reference) == ("succeeded", "RF-1")
    assert "spool delivered=1 remaining=0 damaged=0 refused=0" in caplog.text


def test_a_call_delivers_a_bounded_part_of_a_long_spool(
    live_server: Any, token: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call waits for what it delivers: after a long outage, each of the calls that
    follow takes its part (here 2 records a call, instead of 100)."""
    monkeypatch.setattr("ledger.client.runtime.AUTO_FLUSH_RECORDS", 2)
    spool = Spool(tmp_path / "spool.jsonl")
    for n in range(3):
        spool.append(Record(f"/api/v1/invocations/inv-{n}/attempts/a1/outcome", {"kind": "won"}))
    client = LedgerClient(live_server.url, token, spool=str(spool.path))
    invoke(client, Tool(), key="k-1")
    assert [record.path for record in spool.pending()] == [
        "/api/v1/invocations/inv-2/attempts/a1/outcome"
    ]
    invoke(client, Tool(), key="k-2")
    assert spool.pending() == []


def test_a_slow_ledger_delays_a_call_by_one_requests_time_of_delivery(
    live_server: Any, token: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each spooled outcome takes the ledger 0.3 s to answer and the client's timeout
    is 0.5 s: after its own outcome, the call delivers no record begun past its timeout
    (one or two of five, by the machine's speed), and leaves the rest to the next call,
    without a warning."""

    def slow_deliveries(request: httpx.Request) -> None:
        if "/inv-spooled-" in request.url.path:
            time.sleep(0.3)  # fault pause: the ledger slow to answer

    spool = Spool(tmp_path / "spool.jsonl")
    for n in range(5):
        LedgerClient(live_server.url, token).request("POST", "/api/v1/intents", {
            "invocation_id": f"inv-spooled-{n}", "task_id": "t", "capability": "refund.create",
            "arguments": {}, "idempotency_key": f"k-spooled-{n}", "attempt_id": "a1",
        })  # fmt: skip
        path = f"/api/v1/invocations/inv-spooled-{n}/attempts/a1/outcome"
        spool.append(Record(path, {"kind": "succeeded"}))
    client = LedgerClient(
        live_server.url, token, spool=str(spool.path), timeout=0.5,
        transport=InterposedTransport(slow_deliveries),
    )  # fmt: skip
    caplog.set_level("INFO", logger="ledger.client")
    assert invoke(client, Tool(), key="k-1").kind == "succeeded"
    remaining = len(spool.pending())
    assert 3 <= remaining <= 4
    assert [r.levelname for r in caplog.records if r.name == "ledger.client"] == ["INFO"]


def test_an_automatic_delivery_never_fails_the_call_it_follows(
    live_server: Any,
    token: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record the ledger can never take is set aside and logged as a warning, and a
    spool that cannot be rewritten is logged as an error: the call's own result stands."""
    spool = Spool(tmp_path / "spool.jsonl")
    spool.append(Record("/api/v1/invocations/inv-x/attempts/a1/outcome", {"kind": "won"}))
    client = LedgerClient(live_server.url, token, spool=str(spool.path))
    assert invoke(client, Tool(), key="k-1").kind == "succeeded"
    assert spool.pending() == []
    assert Path(f"{spool.path}.refused").exists()
    assert [r.levelname for r in caplog.records if r.name == "ledger.client"] == ["WARNING"]

    spool.append(Record("/api/v1/invocations/inv-x/attempts/a1/outcome", {"kind": "won"}))

    def disk_full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Spool, "_rewrite", disk_full)
    assert invoke(client, Tool(), key="k-2").kind == "succeeded"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in errors] == ["spool delivery failed"]
    assert len(spool.pending()) == 1


def test_threads_ending_together_deliver_the_spool_once(
    live_server: Any, token: str, slow_deliveries: SlowDeliveries
) -> None:
    """Five threads of one client end their calls at once while the spool holds a
    record: one delivers it, the others return without queueing for the spool."""
    client = LedgerClient(live_server.url, token, spool=str(slow_deliveries.spool.path))
    together = threading.Barrier(5)

    def refund(context: CallContext) -> dict[str, str]:
        together.wait(timeout=30)
        return {"id": f"RF-{context.idempotency_key}"}

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        calls = [pool.submit(invoke, client, Tool(refund), f"k-{n}") for n in range(5)]
        kinds = {call.result().kind for call in calls}
    assert kinds == {"succeeded"}
    assert slow_deliveries.count == 1
    assert slow_deliveries.spool.pending() == []
