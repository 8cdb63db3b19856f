"""What the runtime API accepts: the write bodies, checked by msgspec.

Each body is a msgspec Struct: types, lengths, patterns and unknown fields are
checked in C (about a microsecond a body; the DRF serializers this replaced took
~140 µs, which was most of a batch item's validation). What a type cannot say —
the arguments' digest, JSON limits, which fields go together — is checked by the
function that turns the struct into the services' dataclass, which also moves
timestamps to UTC. A refusal is a DRF ValidationError naming every field at fault, so
it becomes the typed `validation_failed` body.

The same structs give the OpenAPI schema its request bodies (`schema_components`),
so the documentation cannot drift from what is enforced.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any

import msgspec
from django.conf import settings
from msgspec import UNSET, Meta, Struct, UnsetType
from rest_framework.exceptions import ValidationError

from ledger import chain, policy
from ledger.identifiers import IDENTIFIER_HINT, IDENTIFIER_REGEX
from ledger.services import AttemptInput, EvidenceInput, IntentInput, OutcomeInput

IDENTIFIER_LENGTH = 128
# As for identifiers (ledger/identifiers.py): `(?!\n)` refuses a final newline, which
# Python's `$` would let through, and keeps the patterns valid ECMAScript.
SCOPE_REGEX = r"^[A-Za-z0-9][A-Za-z0-9._:-]*(?!\n)$"
PRINTABLE_REGEX = r"^[^\x00-\x1f\x7f]*(?!\n)$"
NO_NUL_REGEX = r"^[^\x00]*$"
DIGEST_REGEX = r"^sha256:[0-9a-f]{64}(?!\n)$"
# W3C Trace Context: version ff and an all-zero trace or parent id are invalid.
TRACEPARENT_REGEX = (
    r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(?!\n)$"
)
IDENTIFIER_PATTERN = re.compile(IDENTIFIER_REGEX)

# msgspec names the pattern a string missed; people are told what to send instead.
PATTERN_HINTS = {
    IDENTIFIER_REGEX: IDENTIFIER_HINT,
    SCOPE_REGEX: "An ACC scope: letters, digits and . _ : - only, starting with a letter or digit.",
    PRINTABLE_REGEX: "Control characters are not allowed.",
    NO_NUL_REGEX: "U+0000 (NUL) is not allowed.",
    DIGEST_REGEX: "Expected 'sha256:' and 64 hex digits.",
    TRACEPARENT_REGEX: "Not a W3C traceparent.",
}

# msgspec prints a pattern as Python's repr would, backslashes doubled.
_PRINTED_PATTERN_HINTS = {repr(regex)[1:-1]: hint for regex, hint in PATTERN_HINTS.items()}

Identifier = Annotated[str, Meta(max_length=IDENTIFIER_LENGTH, pattern=IDENTIFIER_REGEX)]
Scope = Annotated[str, Meta(max_length=160, pattern=SCOPE_REGEX)]
Subject = Annotated[str, Meta(max_length=256, pattern=PRINTABLE_REGEX)]
IdempotencyKey = Annotated[str, Meta(min_length=1, max_length=256, pattern=PRINTABLE_REGEX)]
Digest = Annotated[str, Meta(pattern=DIGEST_REGEX)]
Traceparent = Annotated[str, Meta(pattern=TRACEPARENT_REGEX)]
# A timestamp without an offset would be read in someone's local time: refused.
Instant = Annotated[dt.datetime, Meta(tz=True)]


class Body(Struct, forbid_unknown_fields=True, kw_only=True):
    """A request body: unknown fields are refused, optional ones may not be null."""


class Intent(Body):
    invocation_id: Identifier
    task_id: Identifier
    capability: Scope
    idempotency_key: IdempotencyKey
    subject: Subject = ""
    # Any JSON, null included; absent means only the digest was sent.
    arguments: Any = UNSET
    arguments_digest: Digest | UnsetType = UNSET
    approval: dict[str, Any] | UnsetType = UNSET
    traceparent: Traceparent | UnsetType = UNSET
    attempt_id: Identifier | UnsetType = UNSET
    requested_at: Instant | UnsetType = UNSET


class Attempt(Body):
    attempt_id: Identifier


class ErrorDetail(Body):
    code: Annotated[str, Meta(max_length=128, pattern=PRINTABLE_REGEX)] = ""
    message: Annotated[str, Meta(max_length=4000, pattern=NO_NUL_REGEX)] = ""


class Outcome(Body):
    kind: policy.OutcomeKind
    retryable: bool = False
    business_reference: Subject = ""
    result: Any = UNSET
    error: ErrorDetail | UnsetType = UNSET
    completed_at: Instant | UnsetType = UNSET


# Batch items: the single call's body plus `type` and the ids the URL would carry.


class IntentItem(Intent, tag_field="type", tag="intent", kw_only=True):
    pass


class AttemptItem(Attempt, tag_field="type", tag="attempt", kw_only=True):
    invocation_id: Identifier


class OutcomeItem(Outcome, tag_field="type", tag="outcome", kw_only=True):
    invocation_id: Identifier
    attempt_id: Identifier


Item = IntentItem | AttemptItem | OutcomeItem


def _refusal(data: Any, body: type[Body], error: msgspec.ValidationError) -> ValidationError:
    """Every field at fault, as `{field: [message]}`.

    msgspec stops at the first problem; on that (rare) path each field is checked
    again on its own, so that one answer names every unknown, missing or invalid
    field, as DESIGN's error table asks.
    """
    if not isinstance(data, dict):
        return ValidationError({"non_field_errors": [str(error)]})
    fields = msgspec.structs.fields(body)
    known = {field.encode_name for field in fields}
    tag_field = body.__struct_config__.tag_field
    if tag_field:
        known.add(tag_field)
    problems: dict[str, list[str]] = {
        name: ["Unknown field."] for name in sorted(data.keys() - known)
    }
    for field in fields:
        if field.encode_name not in data:
            if field.required:
                problems[field.encode_name] = ["This field is required."]
            continue
        try:
            msgspec.convert(data[field.encode_name], field.type)
        except msgspec.ValidationError as invalid:
            problems[field.encode_name] = [_message(str(invalid), field.encode_name)]
    return ValidationError(problems or {"non_field_errors": [str(error)]})


def _message(message: str, field: str) -> str:
    """msgspec's message about one field's value, placed at `$.field…`."""
    at = re.search(r" - at `\$([^`]*)`$", message)
    if at:
        message = message[: at.start()]
    path = f"$.{field}{at[1] if at else ''}"
    if (pattern := re.search(r"matching regex '(.*)'", message)) and (
        hint := _PRINTED_PATTERN_HINTS.get(pattern[1])
    ):
        return hint if path == f"$.{field}" else f"{hint} (at `{path}`)"
    return f"{message} - at `{path}`"


def _convert[T: Body](data: Any, body: type[T]) -> T:
    try:
        return msgspec.convert(data, body)
    except msgspec.ValidationError as error:
        raise _refusal(data, body, error) from None


def check_json_value(value: Any) -> None:
    """Depth, I-JSON number and NUL limits, naming the first offending path."""
    max_depth = settings.LEDGER_MAX_JSON_DEPTH
    stack: list[tuple[Any, str, int]] = [(value, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > max_depth:
            raise ValidationError(f"{path}: nested deeper than {max_depth} levels.")
        if isinstance(node, dict):
            for key in node:
                if "\x00" in key:
                    raise ValidationError(f"{path}: a key holds U+0000 (NUL).")
            stack.extend((item, f"{path}.{key}", depth + 1) for key, item in node.items())
        elif isinstance(node, str):
            if "\x00" in node:
                # PostgreSQL's jsonb cannot store it; refuse before anything is written.
                raise ValidationError(f"{path}: U+0000 (NUL) is not allowed.")
        elif isinstance(node, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node))
        elif (
            isinstance(node, int)
            and not isinstance(node, bool)
            and abs(node) > chain.MAX_SAFE_INTEGER
        ):
            raise ValidationError(
                f"{path}: integers beyond ±2^53-1 lose precision; send them as strings."
            )


def _json_digest(field: str, value: Any) -> str:
    """`value` checked as a stored JSON value, and its digest."""
    try:
        check_json_value(value)
        return chain.digest(value)
    except ValidationError as error:
        raise ValidationError({field: error.detail}) from None
    except chain.CanonicalizationError as error:
        raise ValidationError({field: [str(error)]}) from None


def _in_utc(value: dt.datetime | UnsetType, field: str) -> dt.datetime | None:
    """The instant in UTC: RFC 3339 allows offsets up to ±23:59, PostgreSQL ±15:59."""
    if isinstance(value, UnsetType):
        return None
    try:
        return value.astimezone(dt.UTC)
    except OverflowError:
        raise ValidationError({field: ["Out of range once moved to UTC."]}) from None


def _optional[T](value: T | UnsetType) -> T | None:
    return None if value is UNSET else value  # type: ignore[return-value]


def intent(data: Any) -> IntentInput:
    return _intent(_convert(data, Intent))


def _intent(body: Intent) -> IntentInput:
    has_arguments = body.arguments is not UNSET
    sent_digest = _optional(body.arguments_digest)
    if has_arguments:
        digest = _json_digest("arguments", body.arguments)
        if sent_digest is not None and sent_digest != digest:
            raise ValidationError(
                {"arguments_digest": [f"Does not match the arguments ({digest})."]}
            )
    elif sent_digest is None:
        raise ValidationError(
            {"arguments": ["Send the arguments, or at least their arguments_digest."]}
        )
    else:
        digest = sent_digest
    approval = _optional(body.approval)
    if approval is not None:
        _json_digest("approval", approval)
    return IntentInput(
        invocation_id=body.invocation_id,
        task_id=body.task_id,
        capability=body.capability,
        idempotency_key=body.idempotency_key,
        subject=body.subject,
        arguments=body.arguments if has_arguments else None,
        has_arguments=has_arguments,
        arguments_digest=digest,
        approval=approval,
        traceparent=_optional(body.traceparent) or "",
        attempt_id=_optional(body.attempt_id),
        requested_at=_in_utc(body.requested_at, "requested_at"),
    )


def attempt(data: Any, invocation_id: str) -> AttemptInput:
    body = _convert(data, Attempt)
    return AttemptInput(invocation_id=invocation_id, attempt_id=body.attempt_id)


def outcome(data: Any, invocation_id: str, attempt_id: str) -> OutcomeInput:
    return _outcome(_convert(data, Outcome), invocation_id, attempt_id)


NEVER_REACHED_THE_BUSINESS = {
    policy.OutcomeKind.PRE_DISPATCH_REJECTED,
    policy.OutcomeKind.DISPATCH_NOT_ESTABLISHED,
}


def _outcome(body: Outcome, invocation_id: str, attempt_id: str) -> OutcomeInput:
    result_digest = "" if body.result is UNSET else _json_digest("result", body.result)
    if body.retryable and body.kind != policy.OutcomeKind.BUSINESS_FAILED:
        raise ValidationError({"retryable": ["Only a business_failed outcome carries retryable."]})
    # A business reference is the business system's name for what it did: a call that
    # never left the runtime, or that may never have been sent, cannot have one.
    if body.business_reference and body.kind in NEVER_REACHED_THE_BUSINESS:
        raise ValidationError(
            {"business_reference": [f"A {body.kind.value} outcome names no business reference."]}
        )
    error = _optional(body.error) or ErrorDetail()
    return OutcomeInput(
        invocation_id=invocation_id,
        attempt_id=attempt_id,
        kind=body.kind,
        retryable=body.retryable,
        business_reference=body.business_reference,
        result=None if body.result is UNSET else body.result,
        result_digest=result_digest,
        error_code=error.code,
        error_message=error.message,
        completed_at=_in_utc(body.completed_at, "completed_at"),
    )


ITEMS: dict[str, type[IntentItem | AttemptItem | OutcomeItem]] = {
    "intent": IntentItem,
    "attempt": AttemptItem,
    "outcome": OutcomeItem,
}


def item(data: Any) -> EvidenceInput:
    """One batch item: an intent, attempt or outcome, by its `type`."""
    if not isinstance(data, dict):
        raise ValidationError({"non_field_errors": ["Each item must be a JSON object."]})
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in ITEMS:
        raise ValidationError({"type": ["Must be one of: intent, attempt, outcome."]})
    body = _convert(data, ITEMS[kind])
    if isinstance(body, IntentItem):
        return _intent(body)
    if isinstance(body, AttemptItem):
        return AttemptInput(invocation_id=body.invocation_id, attempt_id=body.attempt_id)
    return _outcome(body, body.invocation_id, body.attempt_id)


REF_TEMPLATE = "#/components/schemas/{name}"
_REFS, COMPONENTS = msgspec.json.schema_components(
    [Intent, Attempt, Outcome, list[Item]], ref_template=REF_TEMPLATE
)
INTENT_SCHEMA, ATTEMPT_SCHEMA, OUTCOME_SCHEMA, BATCH_SCHEMA = _REFS
for _component in COMPONENTS.values():
    # JSON Schema allows `"required": []`; OpenAPI 3.0 does not.
    if _component.get("required") == []:
        del _component["required"]


def add_schema_components(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the request bodies' components, and each
    body that uses one marked required (drf-spectacular cannot tell for a raw schema,
    and a POST without its body is refused)."""
    result.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENTS)
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            body = operation.get("requestBody", {})
            if body.get("content", {}).get("application/json", {}).get("schema") in _REFS:
                body["required"] = True
    return result
