"""What a capability's probe configuration may say (`Capability.probe`).

reconciliation/probes.py runs the probes; this module only says which configurations
are well formed, so that an administrator's typo is refused when it is saved rather
than found by the first invocation that needs it (a probe that can never match turns
every reconciliation into an escalation). Checked with JSON Schema; settings-dependent
rules (the python allow-list) are checked beside it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from jsonschema import Draft202012Validator

# The placeholders an http probe's URL may use (filled URL-quoted by the probe).
URL_PLACEHOLDERS = ("idempotency_key", "invocation_id", "business_reference")
_URL_TEMPLATE = r"^https?://[^{}\s]*(\{(" + "|".join(URL_PLACEHOLDERS) + r")\}[^{}\s]*)*$"

_TIMEOUT = {"type": "number", "exclusiveMinimum": 0, "maximum": 60}
_STATUS = {"type": "integer", "minimum": 100, "maximum": 599}
_NAME = r"^[A-Za-z0-9_]+$"  # as a {secret:NAME}: the end of an environment variable's name
# A header's secret, by name: LEDGER_PROBE_SECRET_<name> in the environment.
SECRET = re.compile(r"\{secret:([A-Za-z0-9_]+)\}")
_PATH = {"type": "string", "pattern": r"^[^.\s]+(\.[^.\s]+)*$"}


def _rule(*, with_reference: bool) -> dict[str, Any]:
    properties: dict[str, Any] = {"status": _STATUS, "json_path": _PATH, "equals": {}}
    if with_reference:
        properties["reference_path"] = _PATH
    return {
        "type": "object",
        "required": ["status"],
        "properties": properties,
        "additionalProperties": False,
        "dependentRequired": {"equals": ["json_path"]},
    }


def _kind(name: str) -> dict[str, Any]:
    return {"properties": {"kind": {"const": name}}, "required": ["kind"]}


SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {"kind": {"enum": ["none", "http", "python"]}},
    "allOf": [
        {
            "if": {"anyOf": [{"not": {"required": ["kind"]}}, _kind("none")]},
            "then": {"properties": {"kind": True}, "additionalProperties": False},
        },
        {
            "if": _kind("http"),
            "then": {
                "required": ["url"],
                "properties": {
                    "kind": True,
                    "url": {"type": "string", "pattern": _URL_TEMPLATE},
                    "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                    # The name of the business system's own TLS files in the settings
                    # (LEDGER_PROBE_CA_FILE_<tls>, LEDGER_PROBE_CLIENT_CERT_<tls>).
                    "tls": {"type": "string", "pattern": _NAME},
                    "connect_timeout": _TIMEOUT,
                    "read_timeout": _TIMEOUT,
                    "present": _rule(with_reference=True),
                    "absent": _rule(with_reference=False),
                },
                "additionalProperties": False,
            },
        },
        {
            "if": _kind("python"),
            "then": {
                "required": ["callable"],
                "properties": {
                    "kind": True,
                    "callable": {"type": "string", "pattern": r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+$"},
                    # How long its answer is waited for; its claim lasts that long
                    # and the time to record it (reconciliation.probes.longest_run).
                    "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
                },
                "additionalProperties": False,
            },
        },
    ],
}

_validator = Draft202012Validator(SCHEMA)

_HINTS = {
    _NAME: "letters, digits and _, naming LEDGER_PROBE_CA_FILE_<name> or "
    "LEDGER_PROBE_CLIENT_CERT_<name> in the settings",
    _URL_TEMPLATE: "an http(s) URL; its placeholders can only be "
    + ", ".join("{" + name + "}" for name in URL_PLACEHOLDERS),
}


# A rule's answer must be the business system's own. "Absent" lets the runtime retry
# the effect, and a status alone would take any 404 (a gateway's while the system is
# deployed, a mistyped or moved URL's) for "never happened"; "present" settles the
# invocation as succeeded, and a status alone would take any 200 (a login page's, an
# empty search's) for the effect.
UNIDENTIFIED = {
    "present": "present: needs 'json_path' or 'reference_path', naming what in the "
    "business system's answer says the effect happened; a status alone would take any "
    "200 (a login page's, an empty search's) for the effect",
    "absent": "absent: needs 'json_path' and 'equals', naming what in the business "
    "system's answer says there is no such effect; a status alone would take any 404 (a "
    "gateway's, a mistyped URL's) for 'never happened', and the runtime would retry the "
    "effect",
}


def identifies(name: str, rule: Mapping[str, Any]) -> bool:
    """Whether the rule `name` ("present" or "absent") names the business system's own
    answer."""
    if name == "absent":
        return "json_path" in rule and "equals" in rule
    return "json_path" in rule or "reference_path" in rule


def unidentified_rules(config: Mapping[str, Any]) -> list[str]:
    """The rules of an http probe that do not name the business system's answer."""
    if config.get("kind") != "http":
        return []
    return [name for name in UNIDENTIFIED if name in config and not identifies(name, config[name])]


def problems(config: Any) -> list[str]:
    """What is wrong with a probe configuration, each naming where; [] when nothing."""
    found = []
    for error in sorted(_validator.iter_errors(config), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(part) for part in error.absolute_path) or "the configuration"
        hint = _HINTS.get(error.schema.get("pattern", "")) if error.validator == "pattern" else None
        found.append(f"{where}: {error.message}" + (f" ({hint})" if hint else ""))
    if found:
        return found
    kind = config.get("kind", "none")
    if kind == "http" and not ("present" in config or "absent" in config):
        # With neither rule every answer would be inconclusive.
        found.append("the configuration: an http probe needs a 'present' or an 'absent' rule")
    found += [UNIDENTIFIED[name] for name in unidentified_rules(config)]
    if kind == "python" and config["callable"] not in settings.LEDGER_PYTHON_PROBES:
        found.append(f"callable: {config['callable']!r} is not listed in LEDGER_PYTHON_PROBES")
    return found


def unconfigured(config: Mapping[str, Any]) -> list[str]:
    """The settings an http probe names that this process lacks: its header secrets and
    its TLS files. Not a reason to refuse it (they may be set after it is saved), but
    until they are, each of its probes is inconclusive and a person decides."""
    if config.get("kind") != "http":
        return []
    lacking = []
    headers = config.get("headers")
    for header in headers.values() if isinstance(headers, Mapping) else ():
        for name in SECRET.findall(str(header)):
            if name not in settings.LEDGER_PROBE_SECRETS:
                lacking.append(f"secret {name!r}: LEDGER_PROBE_SECRET_{name} is not set")
    name = config.get("tls")
    if (
        isinstance(name, str)
        and name
        and not (
            name in settings.LEDGER_PROBE_CA_FILES or name in settings.LEDGER_PROBE_CLIENT_CERTS
        )
    ):
        lacking.append(
            f"tls {name!r}: neither LEDGER_PROBE_CA_FILE_{name} nor "
            f"LEDGER_PROBE_CLIENT_CERT_{name} is set"
        )
    return lacking


def validate_probe_config(config: Any) -> None:
    """The model field's validator: the admin shows each problem beside the field."""
    found = problems(config)
    if found:
        raise ValidationError(found)
