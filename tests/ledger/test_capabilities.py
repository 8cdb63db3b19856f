from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from ledger import acc
from ledger.capabilities import Registered, capability_register
from ledger.models import Capability, CapabilityDeclaration, Invocation
from tests.conftest import SHARED_ACC, Api

BROKEN = Path(__file__).resolve().parents[1] / "fixtures" / "openapi-broken.yaml"


def import_file(path: Path, *args: str) -> str:
    out = io.StringIO()
    call_command("import_capabilities", str(path), *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_the_example_documents_import_their_capabilities(db: None) -> None:
    for name in ("openapi-basic.yaml", "openapi-approval.yaml", "openapi-subject.yaml"):
        import_file(SHARED_ACC / name)
    capabilities = {c.scope: c for c in Capability.objects.all()}
    assert set(capabilities) == {"order.read", "refund.request.create", "staff.search"}
    refund = capabilities["refund.request.create"]
    assert (refund.risk_level, refund.audit_sensitive, refund.subject_required) == (
        "medium",
        True,
        True,
    )
    assert (refund.readonly, refund.timeout_ms, refund.version) == (False, 10000, 1)
    order = capabilities["order.read"]
    assert (order.readonly, order.idempotent, order.risk_level) == (True, True, "low")


def test_broken_declarations_are_skipped_and_reported_one_by_one(db: None) -> None:
    out = import_file(BROKEN)
    assert list(Capability.objects.values_list("scope", flat=True)) == ["refund.create"]
    skipped = [line for line in out.splitlines() if line.startswith("skipped:")]
    assert len(skipped) == 4
    assert "skipped: GET /refunds: invalid_declaration:" in out
    assert "skipped: DELETE /refunds/{id}: unsupported_version:" in out
    assert "skipped: PATCH /refunds/{id}: invalid_declaration: enabled:" in out
    assert "skipped: PUT /refunds/{id}: invalid_declaration: scope 'refund.create'" in out


def test_a_dry_run_reports_and_writes_nothing(db: None) -> None:
    out = import_file(SHARED_ACC / "openapi-basic.yaml", "--dry-run")
    assert "would be created: order.read" in out
    assert Capability.objects.count() == 0


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\x01not yaml: [",
        b"swagger: '2.0'\npaths: {}\n",
    ],
)
def test_a_malformed_document_is_refused_and_changes_nothing(
    db: None, tmp_path: Path, content: bytes
) -> None:
    import_file(SHARED_ACC / "openapi-basic.yaml")
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(CommandError, match="nothing was imported"):
        import_file(path)
    assert list(Capability.objects.values_list("scope", flat=True)) == ["order.read"]
    assert CapabilityDeclaration.objects.count() == 1


def test_a_nul_written_with_a_yaml_escape_is_refused_by_path(db: None, tmp_path: Path) -> None:
    # PostgreSQL's jsonb could not store it: the import must refuse, not fail in SQL.
    document = (SHARED_ACC / "openapi-basic.yaml").read_text()
    assert "level: low" in document
    path = tmp_path / "nul.yaml"
    path.write_text(document.replace("level: low", 'level: low\n          note: "a\\0b"', 1))
    with pytest.raises(acc.NotAnOpenAPIDocument, match=r"U\+0000"):
        acc.load_document(path.read_bytes())
    with pytest.raises(CommandError, match="nothing was imported"):
        import_file(path)
    assert not Capability.objects.exists()


def test_an_unquoted_date_is_imported_as_the_text_json_would_hold(db: None, tmp_path: Path) -> None:
    document = (SHARED_ACC / "openapi-basic.yaml").read_text()
    assert "            - id: SO202607001\n" in document
    path = tmp_path / "dated.yaml"
    path.write_text(
        document.replace(
            "            - id: SO202607001\n",
            "            - id: SO202607001\n              placed_on: 2026-07-01\n",
            1,
        )
    )
    import_file(path)
    declaration = Capability.objects.get(scope="order.read").declaration
    assert declaration["guidance"]["examples"][0]["placed_on"] == "2026-07-01"


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("!!binary aGVsbG8=", "a bytes is not JSON"),
        ("!!set {a: null}", "a set is not JSON"),
        (".nan", "nan is not a JSON number"),
        ("!!timestamp 2026-07-01", "a date is not JSON"),
        ('"x\\ud800"', "a lone surrogate"),
    ],
)
def test_yaml_values_json_cannot_hold_are_refused_by_path(
    db: None, tmp_path: Path, value: str, problem: str
) -> None:
    document = (SHARED_ACC / "openapi-basic.yaml").read_text()
    path = tmp_path / "odd.yaml"
    path.write_text(document.replace("level: low", f"level: low\n          note: {value}", 1))
    with pytest.raises(acc.NotAnOpenAPIDocument, match=rf"\.risk\.note: {problem}"):
        acc.load_document(path.read_bytes())
    with pytest.raises(CommandError, match="nothing was imported"):
        import_file(path)
    assert not Capability.objects.exists()


def test_a_changed_declaration_is_a_new_version_and_invocations_keep_theirs(
    api: Api,
) -> None:
    base = {"version": 1, "enabled": True, "scope": "refund.create"}
    first = capability_register(declaration=acc.parse(base), source="t", actor="t")
    assert first.outcome is Registered.CREATED
    api.intent()
    again = capability_register(declaration=acc.parse(base), source="t", actor="t")
    assert again.outcome is Registered.UNCHANGED
    changed = {**base, "risk": {"level": "high"}}
    second = capability_register(declaration=acc.parse(changed), source="t", actor="t")
    assert (second.outcome, second.capability.version) == (Registered.UPDATED, 2)
    api.intent(invocation_id="inv-2", idempotency_key="k2")
    versions = dict(Invocation.objects.values_list("invocation_id", "capability_version"))
    assert versions == {"inv-1": 1, "inv-2": 2}
    history = list(
        CapabilityDeclaration.objects.order_by("version").values_list("version", "declaration")
    )
    assert history == [(1, base), (2, changed)]


def test_an_import_keeps_the_administrators_ledger_settings(db: None) -> None:
    import_file(SHARED_ACC / "openapi-basic.yaml")
    Capability.objects.filter(scope="order.read").update(
        idempotency_verified=True, max_attempts=3, redact_paths=["id"]
    )
    document = (SHARED_ACC / "openapi-basic.yaml").read_text().replace("level: low", "level: high")
    path = Path(BROKEN.parent / "_changed.yaml")
    try:
        path.write_text(document)
        import_file(path)
    finally:
        path.unlink()
    order = Capability.objects.get(scope="order.read")
    assert (order.risk_level, order.version) == ("high", 2)
    assert (order.idempotency_verified, order.max_attempts, order.redact_paths) == (
        True,
        3,
        ["id"],
    )


# Governance at intent time -------------------------------------------------------


@pytest.fixture
def approval_capability(db: None) -> Capability:
    import_file(SHARED_ACC / "openapi-approval.yaml")
    return Capability.objects.get(scope="refund.request.create")


def refund_request(api: Api, n: int, **fields: object) -> tuple[int, dict]:
    body = {
        "invocation_id": f"inv-{n}",
        "idempotency_key": f"k-{n}",
        "capability": "refund.request.create",
        "subject": "customer:42",
        **fields,
    }
    return api.intent(**body)


def test_a_matching_when_condition_without_approval_is_flagged(
    api: Api, approval_capability: Capability
) -> None:
    assert refund_request(api, 1, arguments={"amount": 1500})[1]["flags"] == ["approval_missing"]
    assert refund_request(api, 2, arguments={"amount": 10})[1]["flags"] == []
    approved = refund_request(api, 3, arguments={"amount": 1500}, approval={"by": "ops:ada"})
    assert approved[1]["flags"] == []


def test_conditions_that_cannot_be_evaluated_assume_approval_was_needed(
    api: Api, approval_capability: Capability
) -> None:
    wrong_type = refund_request(api, 1, arguments={"amount": "1500"})
    assert wrong_type[1]["flags"] == ["approval_missing"]
    digest_only = refund_request(api, 2, arguments=None, arguments_digest="sha256:" + "0" * 64)
    assert digest_only[1]["flags"] == ["approval_missing"]


def test_subject_required_by_the_declaration_refuses_an_intent_without_one(
    api: Api, approval_capability: Capability
) -> None:
    status, body = refund_request(api, 1, subject="", arguments={"amount": 1})
    assert (status, body["error"]["type"]) == (422, "subject_required")


def test_sensitive_raw_arguments_never_reach_any_table(
    api: Api, approval_capability: Capability
) -> None:
    from django.db import connection

    refund_request(
        api, 1, arguments={"amount": 777777, "reason": "card 4111-SECRET"}, attempt_id="a1"
    )
    api.outcome("inv-1", "a1", kind="succeeded", result={"refund_id": "RF-SECRETREF"})
    with connection.cursor() as cursor:
        for table in ("ledger_invocation", "ledger_attempt", "ledger_outcome", "ledger_event"):
            cursor.execute(f"SELECT coalesce(string_agg(t::text, ' '), '') FROM {table} t")
            dump = cursor.fetchone()[0]
            assert "777777" not in dump and "SECRET" not in dump, table


# The admin API endpoint and the admin upload form ------------------------------


@pytest.fixture
def admin_client(db: None) -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


DECLARATION = {"version": 1, "enabled": True, "scope": "payroll.change", "risk": {"level": "high"}}


def test_an_administrator_posts_a_declaration(admin_client: Client) -> None:
    response = admin_client.post(
        "/api/v1/capabilities", {"declaration": DECLARATION}, content_type="application/json"
    )
    assert response.status_code == 201
    assert response.json()["outcome"] == "created"
    assert Capability.objects.get(scope="payroll.change").risk_level == "high"
    again = admin_client.post(
        "/api/v1/capabilities", {"declaration": DECLARATION}, content_type="application/json"
    )
    assert (again.status_code, again.json()["outcome"]) == (200, "unchanged")


def test_an_invalid_posted_declaration_is_refused_with_its_diagnostic(
    admin_client: Client,
) -> None:
    response = admin_client.post(
        "/api/v1/capabilities",
        {"declaration": {**DECLARATION, "version": 3}},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert response.json()["error"]["details"]["diagnostic"] == "unsupported_version"
    assert not Capability.objects.exists()


def test_a_posted_declaration_holding_nul_is_refused(admin_client: Client) -> None:
    response = admin_client.post(
        "/api/v1/capabilities",
        {"declaration": {**DECLARATION, "description": "refund\x00"}},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert "declaration" in response.json()["error"]["details"]
    assert not Capability.objects.exists()


def test_runtimes_and_non_administrators_cannot_register_capabilities(api: Api) -> None:
    status, body = api.post("/api/v1/capabilities", {"declaration": DECLARATION})
    assert (status, body["error"]["type"]) == (401, "unauthenticated")
    staff = Client()
    staff.force_login(User.objects.create_user("op", password="pw"))
    response = staff.post(
        "/api/v1/capabilities", {"declaration": DECLARATION}, content_type="application/json"
    )
    assert response.status_code == 403
    assert not Capability.objects.exists()


def test_the_admin_upload_form_imports_and_reports(admin_client: Client) -> None:
    page = admin_client.get("/admin/ledger/capability/")
    assert "/admin/ledger/capability/import/" in page.content.decode()
    upload = SimpleUploadedFile("broken.yaml", BROKEN.read_bytes())
    response = admin_client.post("/admin/ledger/capability/import/", {"document": upload})
    html = response.content.decode()
    assert response.status_code == 200
    assert "refund.create" in html and "unsupported_version" in html
    assert Capability.objects.filter(scope="refund.create").exists()


def test_the_admin_upload_form_refuses_a_non_openapi_file(admin_client: Client) -> None:
    upload = SimpleUploadedFile("notes.txt", b"hello: world\n")
    response = admin_client.post("/admin/ledger/capability/import/", {"document": upload})
    assert "not an OpenAPI 3 document" in response.content.decode()
    assert not Capability.objects.exists()


def test_the_admin_shows_declaration_history_read_only(admin_client: Client) -> None:
    import_file(SHARED_ACC / "openapi-basic.yaml")
    capability = Capability.objects.get()
    page = admin_client.get(f"/admin/ledger/capability/{capability.pk}/change/").content.decode()
    assert 'name="risk_level"' not in page  # ACC fields are not editable
    assert 'name="idempotency_verified"' in page
    assert "openapi-basic.yaml GET /orders/{id}" in page
