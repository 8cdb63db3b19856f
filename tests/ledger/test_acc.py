"""ACC v1 against the specification's own files in ../shared/acc/ (read, not copied)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger import acc
from tests.conftest import SHARED_ACC

VECTORS = json.loads((SHARED_ACC / "vectors.json").read_text())["vectors"]


def test_the_corpus_has_all_18_vectors() -> None:
    assert len(VECTORS) == 18


def test_the_bundled_schema_is_the_specifications() -> None:
    bundled = Path(acc.__file__).with_name("acc.v1.schema.json").read_text()
    assert json.loads(bundled) == json.loads((SHARED_ACC / "acc.v1.schema.json").read_text())


def run_vector(vector: dict[str, Any]) -> dict[str, Any]:
    given_ = vector["input"]
    try:
        declaration = acc.parse(given_["declaration"], http_method=given_.get("http_method"))
    except acc.InvalidDeclaration as invalid:
        return {"valid": False, "diagnostic": invalid.diagnostic.value, "exposed": False}
    return {
        "valid": True,
        "exposed": acc.exposed(
            declaration,
            scope_allowed=given_.get("scope_allowed", True),
            trusted_subject=given_.get("trusted_subject", False),
        ),
        "decision": acc.approval_decision(
            declaration, given_.get("args", {}), given_.get("parameter_schema")
        ).value,
        "effective_risk": declaration.risk,
        "audit_sensitive": declaration.audit_sensitive,
    }


@pytest.mark.parametrize("vector", VECTORS, ids=[v["id"] for v in VECTORS])
def test_conformance_vector(vector: dict[str, Any]) -> None:
    outcome = run_vector(vector)
    for key, expected in vector["expected"].items():
        assert outcome[key] == expected, f"{vector['id']}: {vector['assertion']}"


def test_unknown_fields_are_kept_without_meaning() -> None:
    declaration = acc.parse(
        {"version": 1, "enabled": True, "scope": "order.read", "x-vendor": {"team": "ops"}}
    )
    assert declaration.extensions == {"x-vendor": {"team": "ops"}}
    assert declaration.raw["x-vendor"] == {"team": "ops"}


@pytest.mark.parametrize(
    ("raw", "diagnostic"),
    [
        ("not a mapping", acc.Diagnostic.INVALID),
        ({"version": "1", "enabled": True, "scope": "a"}, acc.Diagnostic.INVALID),
        ({"version": True, "enabled": True, "scope": "a"}, acc.Diagnostic.INVALID),
        ({"version": 0, "enabled": True, "scope": "a"}, acc.Diagnostic.UNSUPPORTED_VERSION),
        ({"version": 1, "enabled": True, "scope": "has space"}, acc.Diagnostic.INVALID),
        (
            {"version": 1, "enabled": True, "scope": "a", "risk": {"level": "extreme"}},
            acc.Diagnostic.INVALID,
        ),
    ],
)
def test_it_names_what_is_wrong(raw: object, diagnostic: acc.Diagnostic) -> None:
    with pytest.raises(acc.InvalidDeclaration) as invalid:
        acc.parse(raw)
    assert invalid.value.diagnostic is diagnostic
    assert invalid.value.reason


@pytest.mark.parametrize(
    ("declaration", "method", "risk"),
    [
        ({}, "GET", "low"),
        ({"execution": {"readonly": True}}, "POST", "low"),
        ({}, "POST", "medium"),
        ({}, None, "medium"),
        ({"risk": {"level": "high"}}, "GET", "high"),
    ],
)
def test_risk_defaults_follow_the_specification(
    declaration: dict[str, Any], method: str | None, risk: str
) -> None:
    base = {"version": 1, "enabled": True, "scope": "x"}
    assert acc.parse({**base, **declaration}, http_method=method).risk == risk


# when[] evaluation: ANY semantics and strict types -----------------------------

numbers = st.integers(-(10**6), 10**6) | st.floats(-1e6, 1e6, allow_nan=False)
not_numbers = st.text() | st.booleans() | st.none() | st.lists(st.integers(), max_size=2)


def declaration_with(*conditions: dict[str, Any]) -> acc.Declaration:
    return acc.parse(
        {"version": 1, "enabled": True, "scope": "s", "approval": {"when": list(conditions)}}
    )


@given(op=st.sampled_from([">", ">=", "<", "<="]), actual=numbers, threshold=numbers)
def test_ordering_operators_compare_numbers(op: str, actual: float, threshold: float) -> None:
    condition = {"param": "amount", "op": op, "value": threshold}
    expected = {
        ">": actual > threshold,
        ">=": actual >= threshold,
        "<": actual < threshold,
        "<=": actual <= threshold,
    }[op]
    assert acc.condition_matches(condition, {"amount": actual}) is expected


@given(op=st.sampled_from([">", ">=", "<", "<="]), actual=not_numbers, threshold=numbers)
def test_ordering_a_non_number_is_rejected_not_evaluated(
    op: str, actual: object, threshold: float
) -> None:
    declaration = declaration_with({"param": "amount", "op": op, "value": threshold})
    decision = acc.approval_decision(declaration, {"amount": actual})
    assert decision is acc.Decision.REJECT_INVALID_ARGUMENTS


@given(actual=st.text() | st.integers(), expected=st.text() | st.integers())
def test_equality_is_strict_about_types(actual: object, expected: object) -> None:
    condition = {"param": "p", "op": "==", "value": expected}
    if type(actual) is not type(expected):
        with pytest.raises(acc.WrongType):
            acc.condition_matches(condition, {"p": actual})
    else:
        assert acc.condition_matches(condition, {"p": actual}) is (actual == expected)


@given(
    amounts=st.lists(numbers, min_size=1, max_size=4),
    value=numbers,
)
def test_any_matching_condition_requires_approval(amounts: list[float], value: float) -> None:
    conditions = [{"param": "amount", "op": ">", "value": a} for a in amounts]
    decision = acc.approval_decision(declaration_with(*conditions), {"amount": value})
    expected = any(value > a for a in amounts)
    assert (decision is acc.Decision.APPROVAL_REQUIRED) is expected


@given(values=st.lists(st.text(max_size=3), max_size=5), actual=st.text(max_size=3))
def test_in_and_contains(values: list[str], actual: str) -> None:
    assert acc.condition_matches({"param": "p", "op": "in", "value": values}, {"p": actual}) is (
        actual in values
    )
    assert acc.condition_matches(
        {"param": "p", "op": "contains", "value": actual}, {"p": values}
    ) is (actual in values)


def test_exists_and_nested_parameters() -> None:
    condition = {"param": "customer.tier", "op": "exists"}
    assert acc.condition_matches(condition, {"customer": {"tier": "gold"}})
    assert not acc.condition_matches(condition, {"customer": {}})
    assert not acc.condition_matches({"param": "amount", "op": ">", "value": 1}, {})


# OpenAPI documents ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("openapi-basic.yaml", [("order.read", "GET", "/orders/{id}", "low")]),
        (
            "openapi-approval.yaml",
            [("refund.request.create", "POST", "/refunds/request", "medium")],
        ),
        ("openapi-subject.yaml", [("staff.search", "GET", "/staff/search", "low")]),
    ],
)
def test_the_example_documents_declare_what_they_say(
    name: str, expected: list[tuple[str, str, str, str]]
) -> None:
    document = acc.load_document((SHARED_ACC / name).read_text())
    found = acc.declarations_in(document)
    assert all(isinstance(entry, acc.Found) for entry in found)
    assert [
        (e.declaration.scope, e.method, e.path, e.declaration.risk)
        for e in found
        if isinstance(e, acc.Found)
    ] == expected


@pytest.mark.parametrize(
    "text",
    [
        "{not yaml: [",
        "just a string",
        "[1, 2]",
        "openapi: 2.0\npaths: {}",
        "openapi: 3.1.0\n",
        "openapi: 3.1.0\npaths: {}\n? {a: 1}\n: unhashable key\n",
    ],
)
def test_a_document_that_is_not_openapi_3_is_refused(text: str) -> None:
    with pytest.raises(acc.NotAnOpenAPIDocument):
        acc.load_document(text)


@pytest.mark.parametrize(
    "text",
    [
        "openapi: 3.1.0\npaths: {}\nopenapi: 3.0.0\n",
        '{"openapi": "3.1.0", "paths": {"/r": {"post": {"x-agent-capability": '
        '{"readonly": true, "readonly": false}}}}}',
    ],
    ids=["yaml", "json"],
)
def test_a_document_naming_a_key_twice_is_refused(text: str) -> None:
    with pytest.raises(acc.NotAnOpenAPIDocument, match="appears twice"):
        acc.load_document(text)


def test_yaml_merge_keys_may_still_be_overridden() -> None:
    text = "openapi: 3.1.0\nbase: &b {a: 1}\nx: {<<: *b, a: 2}\npaths: {}\n"
    assert acc.load_document(text)["x"] == {"a": 2}
