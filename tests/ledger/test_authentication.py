from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connection, transaction
from django.db.utils import ProgrammingError
from django.test import Client

from ledger.models import AdminAction, Capability, Invocation, Runtime, RuntimeToken
from tests.conftest import ROOT, Api, intent_body, process_env


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Bearer",
        "Bearer ilr_nope_nope",
        "Token abc",
        "Bearer not-a-token",
        "Bearer ilr__x",
        "Bearer ilr_0123456789ab_",
        # Never reaches the query (PostgreSQL text cannot hold NUL: it was a 500).
        "Bearer ilr_01234\x006789ab_secret",
    ],
)
def test_it_refuses_missing_and_unknown_tokens(
    db: None, client: Client, header: str | None
) -> None:
    headers = {"Authorization": header} if header else {}
    response = client.post(
        "/api/v1/intents", intent_body(), content_type="application/json", headers=headers
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "unauthenticated"
    assert response["WWW-Authenticate"] == "Bearer"
    assert Invocation.objects.count() == 0


def test_a_revoked_token_is_refused(api: Api, refund: Capability) -> None:
    assert api.intent()[0] == 201
    call_command("revoke_token", api.token)
    status, body = api.intent(invocation_id="inv-2", idempotency_key="k2")
    assert (status, body["error"]["type"]) == (401, "unauthenticated")
    assert Invocation.objects.count() == 1


def test_a_token_with_the_right_prefix_and_wrong_secret_is_refused(api: Api) -> None:
    prefix = RuntimeToken.split(api.token)
    forged = Api(api.client, f"ilr_{prefix}_{'A' * 43}")
    assert forged.intent()[0] == 401


def test_tokens_are_stored_hashed(api: Api) -> None:
    row = RuntimeToken.objects.get()
    assert api.token not in (row.prefix, row.digest)
    assert row.digest == RuntimeToken.hash(api.token)


def test_another_runtimes_invocation_is_not_found(api: Api, api_b: Api, refund: Capability) -> None:
    api.intent(attempt_id="a1")
    for status, body in [
        api_b.get("/api/v1/invocations/inv-1"),
        api_b.attempt("inv-1", "a2"),
        api_b.outcome("inv-1", "a1", kind="succeeded"),
    ]:
        assert (status, body["error"]["type"]) == (404, "not_found")
    assert api_b.get("/api/v1/invocations")[1]["results"] == []
    assert Invocation.objects.get().status == "in_flight"


def test_another_runtime_cannot_reuse_an_invocation_id(
    api: Api, api_b: Api, refund: Capability
) -> None:
    api.intent()
    status, body = api_b.intent(idempotency_key="other")
    assert (status, body["error"]["type"]) == (409, "intent_conflict")
    assert body["error"]["details"] == {}


def test_create_runtime_prints_a_working_token_on_its_last_line(
    db: None, capsys: pytest.CaptureFixture[str]
) -> None:
    call_command("create_runtime", "billing-agent")
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert Runtime.objects.filter(name="billing-agent").exists()
    assert Api(Client(), token).intent()[0] == 201


def test_create_runtime_leaves_the_token_alone_on_a_terminals_last_line(
    transactional_db: None,
) -> None:
    """What a terminal shows: its messages and the log line of the action it records
    (standard error) and the token (standard output), each written as it comes."""
    shown = subprocess.run(
        [sys.executable, "manage.py", "create_runtime", "terminal-agent"],
        cwd=ROOT, env={**process_env(), "LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60,
    )  # fmt: skip
    *before, last = shown.stdout.strip().splitlines()
    assert any("admin action id=" in line for line in before), shown.stdout
    assert Api(Client(), last).intent()[0] == 201


def test_create_runtime_refuses_a_duplicate_name_without_add_token(db: None) -> None:
    from django.core.management.base import CommandError

    call_command("create_runtime", "dup")
    with pytest.raises(CommandError):
        call_command("create_runtime", "dup")
    call_command("create_runtime", "dup", add_token=True)
    assert RuntimeToken.objects.filter(runtime__name="dup").count() == 2


@pytest.mark.parametrize("name", ["", "two words", "red\x1b[31m", "line\nbreak", ".leading"])
def test_create_runtime_refuses_a_name_unfit_for_the_audit_trail(db: None, name: str) -> None:
    """A runtime's name is written into its events as `runtime:<name>`, and into logs
    and exports: blanks, control characters and terminal escapes are refused."""
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="runtime name"):
        call_command("create_runtime", name, stderr=io.StringIO())
    assert not Runtime.objects.exists() and not AdminAction.objects.exists()


def test_the_admin_refuses_such_a_name_too(admin_client: Client) -> None:
    form = {"tokens-TOTAL_FORMS": "0", "tokens-INITIAL_FORMS": "0"}
    page = admin_client.post("/admin/ledger/runtime/add/", {**form, "name": "two words"})
    assert "Use letters, digits and" in page.content.decode() and not Runtime.objects.exists()
    added = admin_client.post("/admin/ledger/runtime/add/", {**form, "name": "two-words"})
    assert added.status_code == 302 and Runtime.objects.get().name == "two-words"


@pytest.fixture
def two_a_minute(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The runtime throttle at 2/min, on a clock the test moves (monotonic seconds)."""
    from ledger.api import throttling

    clock = [1000.0]
    monkeypatch.setattr(throttling.RuntimeTokenThrottle, "rate", "2/min")
    monkeypatch.setattr(throttling.time, "monotonic", lambda: clock[0])
    throttling.RuntimeTokenThrottle.reset()
    yield clock
    throttling.RuntimeTokenThrottle.reset()


def statuses(api: Api, count: int) -> list[int]:
    return [api.get("/api/v1/invocations")[0] for _ in range(count)]


def test_a_throttled_token_gets_429_with_retry_after(
    api: Api, refund: Capability, two_a_minute: list[float]
) -> None:
    assert statuses(api, 2) == [200, 200]
    response = api.client.get("/api/v1/invocations", headers=api.headers())
    assert response.status_code == 429
    assert response.json()["error"]["type"] == "rate_limited"
    # The allowance comes back evenly over the minute: one request every 30 seconds.
    assert response["Retry-After"] == "30"


def test_the_allowance_comes_back_evenly_and_never_beyond_the_rate(
    api: Api, refund: Capability, two_a_minute: list[float]
) -> None:
    assert statuses(api, 3) == [200, 200, 429]
    two_a_minute[0] += 29
    refused = api.client.get("/api/v1/invocations", headers=api.headers())
    assert (refused.status_code, refused["Retry-After"]) == (429, "1")
    two_a_minute[0] += 1
    assert statuses(api, 2) == [200, 429]
    two_a_minute[0] += 600  # idle for ten periods: still only one period's allowance
    assert statuses(api, 3) == [200, 200, 429]


def test_each_token_has_its_own_allowance(
    api: Api, refund: Capability, two_a_minute: list[float]
) -> None:
    out = io.StringIO()
    call_command("create_runtime", "second", stdout=out)
    second = Api(client=api.client, token=out.getvalue().strip().splitlines()[-1])
    assert statuses(api, 3) == [200, 200, 429]
    assert statuses(second, 3) == [200, 200, 429]


@pytest.mark.parametrize("rate", ["", "0/min", "ten/min", "10/fortnight", "10", "-1/s"])
def test_a_malformed_throttle_rate_stops_the_ledger_from_starting(
    monkeypatch: pytest.MonkeyPatch, rate: str
) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from ledger.settings import env_rate

    monkeypatch.setenv("LEDGER_THROTTLE_RATE", rate)
    with pytest.raises(ImproperlyConfigured, match="LEDGER_THROTTLE_RATE must be a rate"):
        env_rate("LEDGER_THROTTLE_RATE", "50000/min")
    monkeypatch.setenv("LEDGER_THROTTLE_RATE", "600/minute")
    assert env_rate("LEDGER_THROTTLE_RATE", "50000/min") == "600/minute"


def test_a_runtimes_name_cannot_be_changed_in_the_admin(admin_client: Client) -> None:
    """Its events name it as their actor, and web processes remember it with its tokens."""
    runtime = Runtime.objects.create(name="runtime-a")

    response = admin_client.post(
        f"/admin/ledger/runtime/{runtime.pk}/change/",
        {
            "name": "renamed",
            "created_at_0": "2026-01-01",
            "created_at_1": "00:00:00",
            "tokens-TOTAL_FORMS": "0",
            "tokens-INITIAL_FORMS": "0",
        },
    )

    assert response.status_code == 302
    runtime.refresh_from_db()
    assert runtime.name == "runtime-a"


def rename_with_the_orm(runtime: Runtime) -> None:
    Runtime.objects.filter(pk=runtime.pk).update(name="renamed")


def rename_with_sql(runtime: Runtime) -> None:
    with connection.cursor() as cursor:
        cursor.execute("UPDATE ledger_runtime SET name = 'renamed' WHERE id = %s", [runtime.pk])


@pytest.mark.parametrize("rename", [rename_with_the_orm, rename_with_sql])
def test_postgres_refuses_to_rename_a_runtime(db: None, rename: Callable[[Runtime], None]) -> None:
    runtime = Runtime.objects.create(name="runtime-a")

    with (
        pytest.raises(ProgrammingError, match="name is immutable: runtime-a cannot become"),
        transaction.atomic(),
    ):
        rename(runtime)

    runtime.refresh_from_db()
    assert runtime.name == "runtime-a"
    # What leaves the name as it is still saves: the admin's change form does this.
    runtime.created_at = runtime.created_at.replace(year=2025)
    runtime.save()
    runtime.refresh_from_db()
    assert runtime.created_at.year == 2025


def test_the_admin_revokes_every_token_of_a_runtime_and_records_it(admin_client: Client) -> None:
    runtime = Runtime.objects.create(name="runtime-a")
    first, _ = RuntimeToken.issue(runtime=runtime)
    second, _ = RuntimeToken.issue(runtime=runtime)
    assert first.revoke(actor="cli:earlier", reason="leaked")
    before = RuntimeToken.objects.get(pk=first.pk).revoked_at

    admin_client.post(
        "/admin/ledger/runtime/",
        {"action": "revoke_tokens", "_selected_action": [runtime.pk]},
    )

    assert RuntimeToken.objects.get(pk=first.pk).revoked_at == before
    assert RuntimeToken.objects.get(pk=second.pk).revoked_at is not None
    recorded = AdminAction.objects.filter(action="token_revoked").order_by("id")
    assert [(a.actor, a.target) for a in recorded] == [
        ("cli:earlier", f"runtime runtime-a, token {first.prefix}"),
        ("user:admin", f"runtime runtime-a, token {second.prefix}"),
    ]


# The runtime add form's empty inline of tokens, which the admin adds none through.
NO_TOKENS = {"tokens-TOTAL_FORMS": "0", "tokens-INITIAL_FORMS": "0"}
ISSUED = re.compile(r'id="issued-token"[^>]* value="(ilr_[^"]+)"')


def test_the_admin_issues_a_token_shown_once_that_authenticates(
    admin_client: Client, refund: Capability
) -> None:
    """Registered in the admin, a runtime is taken to its first token: shown on the
    answer to the POST that issued it, kept from the browser's cache, stored as its
    hash, and on the action log as the command's are."""
    added = admin_client.post("/admin/ledger/runtime/add/", {"name": "runtime-c", **NO_TOKENS})
    runtime = Runtime.objects.get(name="runtime-c")
    issue_url = f"/admin/ledger/runtime/{runtime.pk}/issue-token/"
    assert (added.status_code, added["Location"]) == (302, issue_url)
    asked = admin_client.get(issue_url)
    assert asked.status_code == 200 and not runtime.tokens.exists()

    issued = admin_client.post(issue_url, {"label": "payments agent, prod"})

    assert issued.status_code == 200
    assert "no-store" in issued["Cache-Control"]
    found = ISSUED.search(issued.content.decode())
    assert found is not None
    token = found.group(1)
    (row,) = runtime.tokens.all()
    assert row.label == "payments agent, prod"
    assert row.digest == RuntimeToken.hash(token) and token not in row.digest
    assert token.startswith(f"ilr_{row.prefix}_")
    assert Api(Client(), token).intent(attempt_id="a1")[0] == 201
    assert Invocation.objects.get().runtime == runtime
    recorded = AdminAction.objects.filter(action="token_issued").order_by("id")
    assert [(a.actor, a.target, a.reason) for a in recorded] == [
        ("user:admin", f"runtime runtime-c, token {row.prefix}", "payments agent, prod")
    ]
    # The token is nowhere else to be read again: not on the runtime's page.
    page = admin_client.get(f"/admin/ledger/runtime/{runtime.pk}/change/").content.decode()
    assert token not in page
    assert "Issue a token" in page


def test_a_staff_user_without_the_permission_cannot_issue_a_token(db: None, client: Client) -> None:
    staff = User.objects.create_user("clerk", password="pw", is_staff=True)
    for codename in ("add_runtime", "change_runtime"):
        staff.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(staff)
    added = client.post("/admin/ledger/runtime/add/", {"name": "runtime-a", **NO_TOKENS})
    assert (added.status_code, added["Location"]) == (302, "/admin/ledger/runtime/")
    runtime = Runtime.objects.get(name="runtime-a")
    issue_url = f"/admin/ledger/runtime/{runtime.pk}/issue-token/"

    refused = client.post(issue_url, {"label": "mine"})

    assert refused.status_code == 403
    assert not runtime.tokens.exists()
    assert not AdminAction.objects.filter(action="token_issued").exists()
    page = client.get(f"/admin/ledger/runtime/{runtime.pk}/change/").content.decode()
    assert "Issue a token" not in page


def test_a_revocation_cannot_be_undone_in_the_admin(admin_client: Client) -> None:
    runtime = Runtime.objects.create(name="runtime-a")
    token, _ = RuntimeToken.issue(runtime=runtime)
    assert token.revoke(actor="cli:ops")

    response = admin_client.post(
        f"/admin/ledger/runtime/{runtime.pk}/change/",
        {
            "created_at_0": "2026-01-01",
            "created_at_1": "00:00:00",
            "tokens-TOTAL_FORMS": "1",
            "tokens-INITIAL_FORMS": "1",
            "tokens-0-id": str(token.pk),
            "tokens-0-runtime": str(runtime.pk),
            "tokens-0-label": "relabelled",
            "tokens-0-revoked_at_0": "",
            "tokens-0-revoked_at_1": "",
        },
    )

    assert response.status_code == 302
    token.refresh_from_db()
    assert token.label == "relabelled"  # the form was applied
    assert token.revoked_at is not None
