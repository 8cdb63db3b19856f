"""Agent Capability Contract v1: parsing, defaults, exposure and approval.

Declarations are validated against the specification's own JSON Schema
(`acc.v1.schema.json`, copied unchanged from ../shared/acc/; a test keeps the two
identical). No Django here: the registry (ledger/capabilities.py) stores what this
module accepts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

SCHEMA = json.loads((Path(__file__).with_name("acc.v1.schema.json")).read_text())
VALIDATOR = Draft202012Validator(SCHEMA)
SUPPORTED_VERSION = 1
EXTENSION_KEY = "x-agent-capability"
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Top-level keys the specification gives meaning to; anything else is kept, unused.
KNOWN_KEYS = frozenset(SCHEMA["properties"])


class Diagnostic(StrEnum):
    INVALID = "invalid_declaration"
    UNSUPPORTED_VERSION = "unsupported_version"


class Decision(StrEnum):
    ALLOW = "allow"
    APPROVAL_REQUIRED = "approval_required"
    REJECT_INVALID_ARGUMENTS = "reject_invalid_arguments"


class InvalidDeclaration(ValueError):
    def __init__(self, diagnostic: Diagnostic, reason: str) -> None:
        super().__init__(f"{diagnostic.value}: {reason}")
        self.diagnostic = diagnostic
        self.reason = reason


@dataclass(frozen=True)
class Declaration:
    """A valid ACC v1 declaration with the specification's defaults applied."""

    raw: dict[str, Any]
    scope: str
    enabled: bool
    risk: str
    subject_required: bool
    approval_required: bool
    approval_when: list[dict[str, Any]]
    audit_sensitive: bool
    readonly: bool
    idempotent: bool
    timeout_ms: int | None
    extensions: dict[str, Any] = field(default_factory=dict)


def parse(raw: Any, *, http_method: str | None = None) -> Declaration:
    """Validate and normalize one declaration, or raise InvalidDeclaration."""
    if not isinstance(raw, Mapping):
        raise InvalidDeclaration(Diagnostic.INVALID, "a declaration is a JSON object")
    version = raw.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version != 1:
        raise InvalidDeclaration(
            Diagnostic.UNSUPPORTED_VERSION,
            f"version {version} is not supported (this ledger reads ACC v{SUPPORTED_VERSION})",
        )
    errors = sorted(VALIDATOR.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        reasons = "; ".join(
            f"{'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
            for e in errors
        )
        raise InvalidDeclaration(Diagnostic.INVALID, reasons)
    execution = raw.get("execution") or {}
    approval = raw.get("approval") or {}
    readonly = bool(execution.get("readonly", False))
    declared_risk = (raw.get("risk") or {}).get("level")
    read_method = http_method is not None and http_method.upper() in READ_METHODS
    return Declaration(
        raw=dict(raw),
        scope=raw["scope"],
        enabled=raw["enabled"],
        risk=declared_risk or ("low" if readonly or read_method else "medium"),
        subject_required=bool((raw.get("subject") or {}).get("required", False)),
        approval_required=bool(approval.get("required", False)),
        approval_when=list(approval.get("when") or []),
        audit_sensitive=bool((raw.get("audit") or {}).get("sensitive", False)),
        readonly=readonly,
        idempotent=bool(execution.get("idempotent", False)),
        timeout_ms=execution.get("timeout_ms"),
        extensions={k: v for k, v in raw.items() if k not in KNOWN_KEYS},
    )


def exposed(declaration: Declaration, *, scope_allowed: bool, trusted_subject: bool) -> bool:
    """Whether a runtime may offer the capability to an agent at all."""
    return (
        declaration.enabled
        and scope_allowed
        and (trusted_subject or not declaration.subject_required)
    )


# Approval conditions (`approval.when[]`, ANY semantics) ---------------------


class WrongType(ValueError):
    """An argument's type does not fit the condition it is compared under."""


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


MISSING = object()


def _lookup(arguments: Any, path: str) -> Any:
    node = arguments
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def condition_matches(condition: Mapping[str, Any], arguments: Any) -> bool:
    """One `when` condition. Raises WrongType instead of comparing unlike types."""
    op, expected = condition["op"], condition.get("value")
    actual = _lookup(arguments, condition["param"])
    if op == "exists":
        present = actual is not MISSING and actual is not None
        return present if not isinstance(expected, bool) else present is expected
    if actual is MISSING:
        return False
    if op in (">", ">=", "<", "<="):
        if _json_type(expected) != "number" or _json_type(actual) != "number":
            raise WrongType(f"{condition['param']}: {op} compares numbers only")
        return {
            ">": actual > expected,
            ">=": actual >= expected,
            "<": actual < expected,
            "<=": actual <= expected,
        }[op]
    if op in ("==", "!="):
        if _json_type(actual) != _json_type(expected):
            raise WrongType(
                f"{condition['param']}: {_json_type(actual)} compared with {_json_type(expected)}"
            )
        return (actual == expected) is (op == "==")
    if op == "in":
        if not isinstance(expected, list):
            raise WrongType(f"{condition['param']}: 'in' needs a list of values")
        return any(_json_type(v) == _json_type(actual) and v == actual for v in expected)
    if op == "contains":
        if isinstance(actual, str) and isinstance(expected, str):
            return expected in actual
        if isinstance(actual, list):
            return any(_json_type(v) == _json_type(expected) and v == expected for v in actual)
        raise WrongType(f"{condition['param']}: 'contains' needs a string or a list")
    raise WrongType(f"unknown operator {op!r}")


def approval_decision(
    declaration: Declaration,
    arguments: Any,
    parameter_schema: Mapping[str, Any] | None = None,
) -> Decision:
    """allow / approval_required / reject_invalid_arguments for one call's arguments.

    Arguments that do not fit the parameter schema, or whose types do not fit a
    condition, are rejected before any condition is evaluated.
    """
    schema_ok = parameter_schema is None or Draft202012Validator(parameter_schema).is_valid(
        arguments
    )
    if not schema_ok:
        return Decision.REJECT_INVALID_ARGUMENTS
    try:
        matched = [condition_matches(c, arguments) for c in declaration.approval_when]
    except WrongType:
        return Decision.REJECT_INVALID_ARGUMENTS
    if declaration.approval_required or any(matched):
        return Decision.APPROVAL_REQUIRED
    return Decision.ALLOW


# OpenAPI documents ------------------------------------------------------------


class NotAnOpenAPIDocument(ValueError):
    pass


@dataclass(frozen=True)
class Found:
    path: str
    method: str
    declaration: Declaration


@dataclass(frozen=True)
class Skipped:
    path: str
    method: str
    diagnostic: str
    reason: str


class _JSONCompatibleLoader(yaml.SafeLoader):
    """YAML read as the JSON it stands for: an unquoted 2026-07-01 stays a string,
    and a key named twice in one mapping is an error.

    OpenAPI documents are JSON in YAML's clothing, and what is imported is stored as
    JSON; the safe loader would turn such a value into a `date`, which cannot be. It
    would also keep the last of two `readonly:` in a declaration, where another
    reader of the same file may keep the first.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges on purpose; its keys may be overridden
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the safe loader refuses it, with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_JSONCompatibleLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_document(text: str | bytes) -> dict[str, Any]:
    """An OpenAPI 3 document from YAML or JSON text, or NotAnOpenAPIDocument."""
    try:
        document = yaml.load(text, Loader=_JSONCompatibleLoader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as exc:
        raise NotAnOpenAPIDocument(f"not YAML or JSON: {exc}") from None
    if not isinstance(document, dict):
        raise NotAnOpenAPIDocument("the document is not a mapping")
    problem = _not_storable(document, "$")
    if problem is not None:
        raise NotAnOpenAPIDocument(problem)
    version = document.get("openapi")
    if not isinstance(version, str) or not version.startswith("3."):
        raise NotAnOpenAPIDocument("not an OpenAPI 3 document (no 'openapi: 3.x' field)")
    if not isinstance(document.get("paths"), dict):
        raise NotAnOpenAPIDocument("an OpenAPI document needs a 'paths' object")
    return document


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _not_storable(value: Any, path: str) -> str | None:
    """What is wrong with the first value PostgreSQL's jsonb could not store, or None.

    YAML can still say what jsonb cannot hold: U+0000 with its "\\0" escape, a lone
    surrogate with "\\ud800", binary data, sets, timestamps with an explicit tag, .nan
    and .inf, keys that are lists.
    """
    if isinstance(value, str):
        if "\x00" in value:
            return f"{path}: U+0000 (NUL) is not allowed"
        return None if value.isascii() or _is_unicode(value) else f"{path}: a lone surrogate"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int | float | bool) and key is not None:
                return f"{path}: a key that is a {type(key).__name__} is not JSON"
            if isinstance(key, str) and ("\x00" in key or not _is_unicode(key)):
                return f"{path}: a key holds U+0000 (NUL) or a lone surrogate"
            found = _not_storable(item, f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _not_storable(item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path}: {value} is not a JSON number"
    if value is None or isinstance(value, bool | int | float):
        return None
    return f"{path}: a {type(value).__name__} is not JSON"


def declarations_in(document: Mapping[str, Any]) -> list[Found | Skipped]:
    """Every operation carrying x-agent-capability, parsed or skipped with a reason."""
    results: list[Found | Skipped] = []
    scopes: dict[str, str] = {}
    for path, item in document["paths"].items():
        if not isinstance(item, Mapping):
            continue
        for method in HTTP_METHODS:
            operation = item.get(method)
            if not isinstance(operation, Mapping) or EXTENSION_KEY not in operation:
                continue
            where = f"{method.upper()} {path}"
            try:
                declaration = parse(operation[EXTENSION_KEY], http_method=method)
            except InvalidDeclaration as invalid:
                results.append(Skipped(path, method.upper(), invalid.diagnostic, invalid.reason))
                continue
            if declaration.scope in scopes:
                earlier = scopes[declaration.scope]
                reason = f"scope {declaration.scope!r} is already declared by {earlier}"
                results.append(Skipped(path, method.upper(), Diagnostic.INVALID, reason))
                continue
            scopes[declaration.scope] = where
            results.append(Found(path, method.upper(), declaration))
    return results
