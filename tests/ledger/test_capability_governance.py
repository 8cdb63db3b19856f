"""The capability registry on the record: every declaration registered and every
change of a capability's ledger settings is an action of the hash-chained action log,
and verification checks each capability and declaration against it."""

from __future__ import annotations

import datetime as dt
import io
import re

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.utils import timezone

from ledger import acc, chain
from ledger.capabilities import (
    DECLARATION_REGISTERED,
    SETTINGS_CHANGED,
    ReasonRequired,
    Registered,
    capability_register,
    capability_settings_change,
)
from ledger.integrity import CAPABILITY_ADVICE, verify, verify_next_slice
from ledger.models import AdminAction, Capability, CapabilityDeclaration
from tests.conftest import SHARED_ACC, Api, invocation_rows_read, person, registered
from tests.ledger.conftest import at_migration, superuser_sql


def capability_breaks() -> list[str]:
    return [str(broken) for broken in verify().breaks if broken.what == "capability"]


def test_registrations_and_settings_changes_are_recorded_with_what_they_left(db: None) -> None:
    call_command(
        "import_capabilities", str(SHARED_ACC / "openapi-basic.yaml"), stdout=io.StringIO()
    )
    scopes = sorted(Capability.objects.values_list("scope", flat=True))
    assert scopes  # the example document declares capabilities
    refund = registered("refund.create", risk_level="high")
    changed = capability_settings_change(
        scope="refund.create",
        actor="user:ada",
        reason="payments enforces the key atomically since release 42",
        idempotency_verified=True,
        max_attempts=3,
    )

    assert changed == {
        "idempotency_verified": {"from": False, "to": True},
        "max_attempts": {"from": None, "to": 3},
    }
    registrations = AdminAction.objects.filter(action=DECLARATION_REGISTERED).order_by("id")
    assert [a.target for a in registrations] == [*scopes, "refund.create"]
    last = registrations.last()
    assert last is not None
    assert last.details == {
        "version": 1,
        "source": "tests",
        "digest": chain.digest(refund.declaration),
        "fields": {
            "enabled": True, "readonly": False, "idempotent": False, "risk_level": "high",
            "subject_required": False, "audit_sensitive": False, "timeout_ms": None,
        },
    }  # fmt: skip
    change = AdminAction.objects.get(action=SETTINGS_CHANGED)
    assert (change.actor, change.target, change.reason) == (
        "user:ada",
        "refund.create",
        "payments enforces the key atomically since release 42",
    )
    assert change.details["settings"] == {
        "idempotency_verified": True, "max_attempts": 3, "grace_ms": None,
        "redact_paths": [], "probe": {}, "rate_limit_enforced": False,
    }  # fmt: skip
    report = verify()
    assert report.ok, report.breaks
    assert report.capabilities == len(scopes) + 1


def test_a_settings_change_needs_a_reason_and_no_change_records_nothing(db: None) -> None:
    registered("refund.create")
    actions = AdminAction.objects.count()
    with pytest.raises(ReasonRequired):
        capability_settings_change(
            scope="refund.create", actor="user:ada", reason="  ", idempotency_verified=True
        )
    assert Capability.objects.get(scope="refund.create").idempotency_verified is False
    assert (
        capability_settings_change(
            scope="refund.create", actor="user:ada", reason="", max_attempts=None
        )
        == {}
    )
    with pytest.raises(TypeError, match="not ledger settings: readonly"):
        capability_settings_change(
            scope="refund.create", actor="user:ada", reason="why not", readonly=True
        )
    assert AdminAction.objects.count() == actions
    assert verify().ok


def test_the_admin_records_a_settings_change_with_its_reason(admin_client: Client) -> None:
    capability = registered("refund.create", risk_level="high")
    form = {
        "idempotency_verified": "on", "max_attempts": "", "grace_ms": "", "redact_paths": "",
        "probe": "{}", "declarations-TOTAL_FORMS": 0, "declarations-INITIAL_FORMS": 0,
    }  # fmt: skip
    refused = admin_client.post(f"/admin/ledger/capability/{capability.pk}/change/", form)
    assert "Say why idempotency_verified change" in refused.content.decode()
    capability.refresh_from_db()
    assert capability.idempotency_verified is False
    form["reason"] = "payments enforces the key atomically"
    saved = admin_client.post(f"/admin/ledger/capability/{capability.pk}/change/", form)
    assert saved.status_code == 302
    change = AdminAction.objects.get(action=SETTINGS_CHANGED)
    assert (change.actor, change.reason) == ("user:admin", "payments enforces the key atomically")
    assert change.details["changed"] == {"idempotency_verified": {"from": False, "to": True}}
    assert verify().ok


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        (
            "UPDATE ledger_capability SET idempotency_verified = true",
            "capability broken at capability refund.create: expected idempotency_verified "
            "false, found idempotency_verified true",
        ),
        (
            "UPDATE ledger_capability SET enabled = false, risk_level = 'low'",
            "capability broken at capability refund.create: expected enabled true, "
            'risk_level "high", found enabled false, risk_level "low"',
        ),
        (
            'UPDATE ledger_capability SET probe = \'{"kind": "none"}\'',
            "capability broken at capability refund.create: expected probe {}, "
            'found probe {"kind": "none"}',
        ),
        (
            "INSERT INTO ledger_capability (scope, enabled, readonly, idempotent, "
            "idempotency_verified, risk_level, subject_required, audit_sensitive, "
            "redact_paths, probe, declaration, version, created_at, updated_at) VALUES "
            "('payroll.change', true, true, true, false, 'low', false, false, '{}', '{}', "
            "'{}', 0, now(), now())",
            "capability broken at capability payroll.change: expected idempotent false, "
            'readonly false, risk_level "medium", found idempotent true, readonly true, '
            'risk_level "low"',
        ),
    ],
    ids=["a setting", "declared fields", "the probe", "a row the registry never made"],
)
def test_a_capability_changed_outside_the_registry_is_found(
    db: None, sql: str, expected: str
) -> None:
    registered("refund.create", risk_level="high")
    assert verify().ok
    superuser_sql(sql)
    assert capability_breaks() == [expected]


def test_a_declaration_rewritten_or_taken_out_is_found(db: None) -> None:
    registered("refund.create", risk_level="high")
    registered("refund.create", risk_level="medium")  # version 2
    first = CapabilityDeclaration.objects.get(version=1)
    rewritten = {**first.declaration, "risk": {"level": "low"}}
    superuser_sql(
        "UPDATE ledger_capabilitydeclaration SET declaration = %s WHERE id = %s",
        chain.canonical(rewritten).decode(),
        first.pk,
    )
    superuser_sql("DELETE FROM ledger_capabilitydeclaration WHERE version = 2")
    assert capability_breaks() == [
        f"capability broken at capability refund.create declaration v1: expected digest "
        f"{chain.digest(first.declaration)}, found {chain.digest(rewritten)}",
        "capability broken at capability refund.create declaration v2: expected the "
        "declaration registered, found none",
    ]


def test_verify_ledger_and_the_background_pass_report_it(db: None) -> None:
    registered("refund.create")
    superuser_sql("UPDATE ledger_capability SET max_attempts = 50")
    out = io.StringIO()
    with pytest.raises(CommandError, match="1 broken link"):
        call_command("verify_ledger", stdout=out)
    assert "BROKEN capability broken at capability refund.create" in out.getvalue()
    assert CAPABILITY_ADVICE in out.getvalue()
    verified = verify_next_slice(invocations=10)
    assert verified is not None
    assert (verified.capabilities, verified.break_count) == (1, 1)
    assert verified.breaks == [
        {
            "break": "capability broken at capability refund.create: expected max_attempts "
            "null, found max_attempts 50",
            "invocation_id": None,
        }
    ]


@pytest.mark.django_db(transaction=True)
def test_the_registry_recorded_before_the_action_log_kept_it_is_recorded_by_the_migration() -> None:
    with at_migration("0030_capability_declaration_append_only"), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO ledger_capability (scope, enabled, readonly, idempotent, "
            "idempotency_verified, risk_level, subject_required, audit_sensitive, "
            "max_attempts, redact_paths, probe, declaration, version, created_at, "
            "updated_at) VALUES ('refund.create', true, false, false, true, 'high', "
            "false, false, 3, '{}', '{}', '{\"version\": 1, \"enabled\": true, "
            '"scope": "refund.create", "risk": {"level": "high"}}\', 2, now(), '
            "now()) RETURNING id"
        )
        (capability_id,) = cursor.fetchone()
        cursor.execute(
            "INSERT INTO ledger_capabilitydeclaration (capability_id, version, "
            "declaration, source, actor, created_at) SELECT %s, v, d::jsonb, 'import', "
            '\'user:ada\', now() FROM (VALUES (1, \'{"version": 1, "enabled": true, '
            '"scope": "refund.create"}\'), (2, %s)) AS t(v, d)',
            [
                capability_id,
                '{"version": 1, "enabled": true, "scope": "refund.create", '
                '"risk": {"level": "high"}}',
            ],
        )
        cursor.execute(
            "INSERT INTO ledger_adminaction (actor, action, target, reason, created_at, "
            "prev_hash, hash) VALUES ('cli:ada', 'token_issued', 'token 1', '', now(), "
            "%s, %s)",
            [chain.GENESIS_HASH, "f" * 64],
        )
    token, *recorded = AdminAction.objects.order_by("id")
    assert [(a.action, a.actor, a.details.get("version")) for a in recorded] == [
        (DECLARATION_REGISTERED, "user:ada", 1),
        (DECLARATION_REGISTERED, "user:ada", 2),
        (SETTINGS_CHANGED, "migration:0031", None),
    ]
    assert recorded[0].prev_hash == token.hash
    assert recorded[2].details["changed"] == {
        "idempotency_verified": {"from": False, "to": True},
        "max_attempts": {"from": None, "to": 3},
    }
    report = verify()
    # The token's row was inserted with a made-up hash; everything the migration
    # appended after it verifies.
    assert [str(b) for b in report.breaks] == [
        f"action broken at admin action {token.pk}: expected hash "
        f"{chain.event_hash(token.prev_hash, token.body())}, found hash {'f' * 64}"
    ]
    assert report.capabilities == 1


def test_the_action_log_page_shows_registrations_and_settings_changes(db: None) -> None:
    registered("refund.create", settings={"max_attempts": 2})
    capability_settings_change(
        scope="refund.create",
        actor="user:ada",
        reason="payments enforces the key atomically",
        idempotency_verified=True,
    )
    page = person("cora", "compliance").get("/audit/actions/").content.decode()
    table = page.split('id="admin-actions"')[1].split("</table>")[0]
    rows = table.split("<tr>")[2:]  # newest first, after the header
    assert [row.split("<td>")[3].split("<")[0] for row in rows] == [
        SETTINGS_CHANGED,
        SETTINGS_CHANGED,
        DECLARATION_REGISTERED,
    ]
    assert "<td>idempotency_verified: false → true</td>" in rows[0]
    assert "<td>payments enforces the key atomically</td>" in rows[0]
    assert "<td>max_attempts: null → 2</td>" in rows[1]
    assert "<td>version 1, from tests</td>" in rows[2]


def test_the_action_log_page_masks_a_secret_in_a_probe_setting(db: None) -> None:
    probe = {
        "kind": "http",
        "url": "https://pay.example/refunds?key={idempotency_key}",
        "headers": {"Authorization": "Bearer sk_live_typed_in_by_mistake"},
        "absent": {"status": 404, "json_path": "error", "equals": "refund_not_found"},
    }
    registered("refund.create", settings={"probe": probe})
    page = person("cora", "compliance").get("/audit/actions/").content.decode()
    assert "sk_live_typed_in_by_mistake" not in page
    assert "&quot;Authorization&quot;: &quot;[redacted]&quot;" in page


def test_a_probe_changed_shows_only_what_changed_and_no_secret(db: None) -> None:
    probe = {
        "kind": "http",
        "url": "https://pay.example/refunds?key={idempotency_key}",
        "headers": {"Authorization": "Bearer sk_live_old"},
        "absent": {"status": 404, "json_path": "error", "equals": "refund_not_found"},
        "read_timeout": 2,
    }
    registered("refund.create", settings={"probe": probe})
    moved = {
        **probe,
        "url": "https://payments.example/refunds?key={idempotency_key}",
        "headers": {"Authorization": "Bearer sk_live_new"},
        "absent": {"status": 404, "json_path": "code", "equals": "no_refund"},
        "connect_timeout": 1,
    }
    del moved["read_timeout"]
    capability_settings_change(
        scope="refund.create", actor="user:ada", reason="payments moved", probe=moved
    )

    newest = AdminAction.objects.latest("id")
    assert newest.change == (
        'probe.absent.equals: "refund_not_found" → "no_refund"; '
        'probe.absent.json_path: "error" → "code"; '
        "probe.connect_timeout: absent → 1; "
        'probe.headers.Authorization: "[redacted]" → "[redacted]"; '
        "probe.read_timeout: 2 → absent; "
        'probe.url: "https://pay.example/refunds?key={idempotency_key}" → '
        '"https://payments.example/refunds?key={idempotency_key}"'
    )
    page = person("cora", "compliance").get("/audit/actions/").content.decode()
    assert "sk_live" not in page


def test_a_capability_changed_outside_the_registry_is_put_back_on_the_record(db: None) -> None:
    declared = {"version": 1, "enabled": True, "scope": "refund.create"}
    registered("refund.create")
    superuser_sql("UPDATE ledger_capability SET enabled = false, idempotency_verified = true")
    assert len(capability_breaks()) == 1

    again = capability_register(declaration=acc.parse(declared), source="re-import", actor="ada")
    capability_settings_change(
        scope="refund.create",
        actor="user:ada",
        reason="switched on by SQL, outside the registry",
        idempotency_verified=False,
    )

    assert (again.outcome, again.capability.version, again.capability.enabled) == (
        Registered.UPDATED,
        2,
        True,
    )
    assert verify().ok
    # Registered once more over an intact row, it changes nothing.
    unchanged = capability_register(declaration=acc.parse(declared), source="again", actor="ada")
    assert (unchanged.outcome, unchanged.capability.version) == (Registered.UNCHANGED, 2)


def test_a_dry_run_says_a_row_changed_outside_the_registry_would_be_put_back(db: None) -> None:
    document = str(SHARED_ACC / "openapi-basic.yaml")
    call_command("import_capabilities", document, stdout=io.StringIO(), stderr=io.StringIO())
    out = io.StringIO()
    call_command("import_capabilities", document, "--dry-run", stdout=out, stderr=io.StringIO())
    assert out.getvalue().startswith("would be unchanged: order.read")
    superuser_sql("UPDATE ledger_capability SET readonly = false")
    out = io.StringIO()
    call_command("import_capabilities", document, "--dry-run", stdout=out, stderr=io.StringIO())
    assert out.getvalue().startswith("would be updated: order.read")


def test_the_capability_page_shows_what_is_in_force_and_how_it_came_to_be(db: None) -> None:
    registered("refund.create", risk_level="high", timeout_ms=2000)
    registered(
        "refund.create",
        risk_level="medium",
        timeout_ms=2000,
        rate_limit={"count": 10, "window": "1m"},
    )
    capability_settings_change(
        scope="refund.create",
        actor="user:ada",
        reason="payments enforces the key atomically",
        idempotency_verified=True,
        probe={
            "kind": "http",
            "url": "https://pay.example/refunds?key={idempotency_key}",
            "headers": {"Authorization": "Bearer {secret:PAYMENTS}"},
            "absent": {"status": 404, "json_path": "error", "equals": "refund_not_found"},
        },
    )
    reviewer = person("cora", "compliance")

    listed = reviewer.get("/audit/capabilities/").content.decode()
    assert '<a href="/audit/capabilities/refund.create/">refund.create</a>' in listed
    assert "<td>10 per 1m, watched</td>" in listed
    page = reviewer.get("/audit/capabilities/refund.create/").content.decode()

    in_force = page.split('id="in-force"')[1].split("</section>")[0]
    for shown in (
        "<dt>declaration</dt><dd>v2</dd>",
        "<dt>risk</dt><dd>medium</dd>",
        "<dt>rate limit</dt><dd>10 per 1m, as declared: the ledger admits every attempt",
        "<dt>timeout</dt><dd>2000 ms</dd>",
        "<dt>idempotency verified</dt><dd>yes</dd>",
        "<dt>maximum attempts</dt><dd>5 (the default)</dd>",
        "<dt>grace</dt><dd>60000 ms (the default)</dd>",
        "&quot;Authorization&quot;: &quot;[redacted]&quot;",
    ):
        assert shown in in_force, shown
    history = page.split('id="capability-history"')[1].split("</table>")[0]
    assert history.count("<tr><td>") == 3
    assert "idempotency_verified: false → true" in history
    assert "payments enforces the key atomically" in history
    assert "version 2, from tests" in history
    assert page.count("<details") == 2 and "<details open><summary>v2," in page
    assert 'href="/audit/?capability=refund.create"' in page


def test_the_capability_pages_are_for_people_with_a_role(db: None, api: Api) -> None:
    registered("refund.create")
    assert person("olga", "operator").get("/audit/capabilities/refund.create/").status_code == 200
    assert person("nobody").get("/audit/capabilities/").status_code == 403
    anonymous = Client().get("/audit/capabilities/refund.create/")
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous["Location"]
    as_runtime = Client().get("/audit/capabilities/", headers=api.headers())
    assert as_runtime.status_code == 302
    assert (
        person("cora", "compliance").get("/audit/capabilities/payroll.change/").status_code == 404
    )


def test_the_capability_list_names_the_scopes_called_without_a_declaration(
    api: Api, api_b: Api, lookup: Capability
) -> None:
    """What an administrator may have to declare: the scopes of the last week's
    undeclared intents, read from those invocations alone."""

    def intent(client: Api, invocation_id: str, capability: str) -> None:
        status, body = client.intent(
            invocation_id=invocation_id, idempotency_key=f"k-{invocation_id}", capability=capability
        )
        assert status == 201, body

    intent(api, "inv-old", "deploy.start")
    superuser_sql(  # recorded eight days ago: out of the page's week
        "UPDATE ledger_invocation SET created_at = %s WHERE invocation_id = 'inv-old'",
        timezone.now() - dt.timedelta(days=8),
    )
    intent(api, "inv-pay-a", "payroll.update")
    intent(api_b, "inv-pay-b", "payroll.update")
    intent(api, "inv-refund", "refund.create")
    registered("refund.create")  # declared since its undeclared intent
    intent(api, "inv-refund-2", "refund.create")
    intent(api, "inv-read", "order.read")

    page, rows_read = invocation_rows_read(
        lambda: person("ada", "admin").get("/audit/capabilities/").content.decode()
    )

    listed = page.split('<table class="undeclared">')[1].split("</table>")[0]
    rows = [
        re.sub(r"<[^>]+>", "|", row).split("|")
        for row in re.findall(r"<tr><td>(.*?)</tr>", listed, re.DOTALL)
    ]
    assert [[cell.strip() for cell in row if cell.strip()][:2] for row in rows] == [
        ["refund.create", "1"],
        ["payroll.update", "2"],
    ]
    assert 'href="/audit/?capability=payroll.update&amp;flag=undeclared"' in listed
    assert '<a href="/audit/capabilities/refund.create/">declared since</a>' in listed
    assert listed.count("not declared") == 1
    assert rows_read == 3
