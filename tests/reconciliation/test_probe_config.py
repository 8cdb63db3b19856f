"""A capability's probe configuration is checked when it is saved: each problem named,
nothing saved. The configurations the project itself uses are valid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from ledger.probe_config import problems
from reconciliation.standin import StandInService
from reconciliation.tasks import reconcile_invocation
from tests.conftest import Api, registered

# The business system's own "no such refund", not any 404.
ABSENT = {"status": 404, "json_path": "error", "equals": "refund_not_found"}


def readme_example() -> dict[str, Any]:
    """The probe the README shows, as it shows it."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("Configure a probe per capability", 1)[1].split("```json\n", 1)[1]
    return json.loads(block.split("```", 1)[0])


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"kind": "none"},
        readme_example(),
        {
            "kind": "http",
            "url": "http://h/r/{invocation_id}/{business_reference}",
            "absent": ABSENT,
        },
    ],
    ids=["empty", "none", "readme", "placeholders"],
)
def test_the_configurations_in_use_are_valid(config: dict[str, Any]) -> None:
    assert problems(config) == []


def test_the_stand_ins_probe_is_valid(standin: StandInService) -> None:
    assert problems(standin.probe_config()) == []


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ([], "the configuration: [] is not of type 'object'"),
        ({"kind": "htp"}, "kind: 'htp' is not one of ['none', 'http', 'python']"),
        ({"kind": "none", "url": "http://h/"}, "Additional properties are not allowed ('url'"),
        ({"kind": "http", "absent": ABSENT}, "'url' is a required property"),
        (
            {"kind": "http", "url": "ftp://h/{idempotency_key}", "absent": ABSENT},
            "url: 'ftp://h/{idempotency_key}' does not match",
        ),
        (
            {"kind": "http", "url": "https://h/?k={idempotency-key}", "absent": ABSENT},
            "its placeholders can only be {idempotency_key}, {invocation_id}, {business_reference}",
        ),
        (
            {"kind": "http", "url": "https://h/", "read_timout": 5, "absent": ABSENT},
            "Additional properties are not allowed ('read_timout'",
        ),
        (
            {"kind": "http", "url": "https://h/", "absent": {"status": "404"}},
            "absent.status: '404' is not of type 'integer'",
        ),
        (
            {"kind": "http", "url": "https://h/", "absent": {"status": 404, "equals": "gone"}},
            "absent: 'json_path' is a dependency of 'equals'",
        ),
        (
            {"kind": "http", "url": "https://h/", "read_timeout": 0, "absent": ABSENT},
            "read_timeout: 0 is less than or equal to the minimum of 0",
        ),
        ({"kind": "http", "url": "https://h/"}, "needs a 'present' or an 'absent' rule"),
        (
            {"kind": "http", "url": "https://h/", "absent": {"status": 404}},
            "absent: needs 'json_path' and 'equals', naming what in the business system's",
        ),
        (
            {"kind": "http", "url": "https://h/", "absent": {"status": 404, "json_path": "e"}},
            "a status alone would take any 404 (a gateway's, a mistyped URL's)",
        ),
        (
            {"kind": "http", "url": "https://h/", "present": {"status": 200}},
            "present: needs 'json_path' or 'reference_path', naming what in the business",
        ),
        (
            {"kind": "python", "callable": "os.system"},
            "'os.system' is not listed in LEDGER_PYTHON_PROBES",
        ),
        ({"kind": "python"}, "'callable' is a required property"),
        (
            {"kind": "http", "url": "https://h/", "tls": "pay-ments", "absent": ABSENT},
            "tls: 'pay-ments' does not match '^[A-Za-z0-9_]+$' (letters, digits and _, naming "
            "LEDGER_PROBE_CA_FILE_<name> or LEDGER_PROBE_CLIENT_CERT_<name> in the settings)",
        ),
    ],
    ids=lambda value: "" if isinstance(value, str) else repr(value)[:40],
)
def test_a_malformed_configuration_names_its_problem(config: Any, problem: str) -> None:
    found = problems(config)
    assert any(problem in line for line in found), found


def test_the_admin_refuses_a_malformed_probe_and_saves_nothing(admin_client: Client) -> None:
    capability = registered("refund.create", risk_level="high")
    form = {
        "idempotency_verified": "", "max_attempts": 5, "grace_ms": 60000, "redact_paths": "",
        "probe": '{"kind": "http", "url": "https://pay.example/r?k={idempotency-key}"}',
        "declarations-TOTAL_FORMS": 0, "declarations-INITIAL_FORMS": 0,
    }  # fmt: skip
    response = admin_client.post(f"/admin/ledger/capability/{capability.pk}/change/", form)
    assert response.status_code == 200  # the form again, with the errors
    page = response.content.decode()
    assert "its placeholders can only be" in page
    capability.refresh_from_db()
    assert capability.probe == {}
    fixed = {
        "kind": "http",
        "url": "https://pay.example/r?k={idempotency_key}",
        "absent": ABSENT,
    }
    form["probe"] = json.dumps(fixed)
    response = admin_client.post(f"/admin/ledger/capability/{capability.pk}/change/", form)
    assert "Say why grace_ms, max_attempts, probe change" in response.content.decode()
    form["reason"] = "payments answers 404 for a refund it never made"
    response = admin_client.post(f"/admin/ledger/capability/{capability.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    capability.refresh_from_db()
    assert capability.probe["absent"] == ABSENT


def test_the_admin_points_at_the_escalations_a_new_probe_could_settle(
    api: Api, admin_client: Client
) -> None:
    capability = registered("refund.create", risk_level="high")
    api.intent(attempt_id="a1")
    api.outcome("inv-1", "a1", kind="post_dispatch_evidence_failed")
    reconcile_invocation.run("inv-1")  # no probe yet: escalated
    form = {
        "idempotency_verified": "", "max_attempts": 5, "grace_ms": 60000, "redact_paths": "",
        "probe": json.dumps({"kind": "http", "url": "https://pay.example/r?k={idempotency_key}",
                             "absent": ABSENT}),
        "reason": "payments can be asked now",
        "declarations-TOTAL_FORMS": 0, "declarations-INITIAL_FORMS": 0,
    }  # fmt: skip

    response = admin_client.post(
        f"/admin/ledger/capability/{capability.pk}/change/", form, follow=True
    )

    assert (
        "1 escalated invocation of refund.create that nobody is on could be settled by its "
        'probe now: <a href="/?capability=refund.create">re-run their probes from the queue</a>'
    ) in response.content.decode()
    assert (
        "Before its probe settles invocations, ask it about a key you know: on "
        '<a href="/audit/capabilities/refund.create/">the page of refund.create</a>.'
    ) in response.content.decode()


def test_settings_a_probe_names_and_the_ledger_lacks_are_said_where_it_is_read(
    admin_client: Client, settings: Any
) -> None:
    """A probe naming a secret or TLS files this ledger has no setting for is saved
    (they may be set after it), with a warning; its capability's page says the same
    until they are set."""
    capability = registered("refund.create")
    probe = {**readme_example(), "headers": {"Authorization": "Bearer {secret:PAYMENTS}"}}
    form = {
        "idempotency_verified": "", "max_attempts": 5, "grace_ms": 60000, "redact_paths": "",
        "probe": json.dumps(probe), "reason": "payments can be asked now",
        "declarations-TOTAL_FORMS": 0, "declarations-INITIAL_FORMS": 0,
    }  # fmt: skip
    settings.LEDGER_PROBE_SECRETS = {}
    settings.LEDGER_PROBE_CA_FILES = {"HR": "/etc/ssl/hr-ca.pem"}
    settings.LEDGER_PROBE_CLIENT_CERTS = {}
    lacking = (
        "secret &#x27;PAYMENTS&#x27;: LEDGER_PROBE_SECRET_PAYMENTS is not set",
        "tls &#x27;PAYMENTS&#x27;: neither LEDGER_PROBE_CA_FILE_PAYMENTS nor "
        "LEDGER_PROBE_CLIENT_CERT_PAYMENTS is set",
    )

    saved = admin_client.post(
        f"/admin/ledger/capability/{capability.pk}/change/", form, follow=True
    ).content.decode()
    capability.refresh_from_db()
    assert capability.probe == probe
    assert "Its probe names settings this ledger lacks" in saved
    assert all(line in saved for line in lacking)
    its_page = admin_client.get("/audit/capabilities/refund.create/").content.decode()
    assert 'id="probe-unconfigured"' in its_page
    assert all(f"<li>{line}</li>" in its_page for line in lacking)

    settings.LEDGER_PROBE_SECRETS = {"PAYMENTS": "sk_live_hush"}
    settings.LEDGER_PROBE_CLIENT_CERTS = {"PAYMENTS": "/etc/ssl/ledger-payments.pem"}
    its_page = admin_client.get("/audit/capabilities/refund.create/").content.decode()
    assert "probe-unconfigured" not in its_page
