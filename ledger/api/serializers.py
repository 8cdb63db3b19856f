"""Input validation and the documented response shapes of the runtime API.

Inputs are plain Serializers that refuse unknown fields; they turn a request into
the services' frozen dataclasses. Responses are built by the services as dicts (the
hot path does no serializer work on the way out); the output serializers here only
describe them for the OpenAPI schema.
"""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.core.validators import RegexValidator
from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

from ledger import chain, policy
from ledger.services import AttemptInput, IntentInput, OutcomeInput

IDENTIFIER_PATTERN = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._:@/+=-]*\Z")
IDENTIFIER = RegexValidator(
    IDENTIFIER_PATTERN,
    "Use letters, digits and . _ : @ / + = - only, starting with a letter or digit.",
    code="invalid_identifier",
)
SCOPE = RegexValidator(
    r"\A[A-Za-z0-9][A-Za-z0-9._:-]*\Z",
    "An ACC scope: letters, digits and . _ : - only, starting with a letter or digit.",
)
PRINTABLE = RegexValidator(
    r"[\x00-\x1f\x7f]", "Control characters are not allowed.", inverse_match=True
)
DIGEST = RegexValidator(r"\Asha256:[0-9a-f]{64}\Z", "Expected 'sha256:' and 64 hex digits.")
TRACEPARENT = RegexValidator(
    r"\A[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\Z", "Not a W3C traceparent."
)
IDENTIFIER_LENGTH = 128


class StrictCharField(serializers.CharField):
    """A JSON string only: DRF would turn 7 into "7", hiding a runtime's bug."""

    default_error_messages = {"invalid": "Must be a string."}

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """true or false only, not "yes" or 1."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


def identifier(**kwargs: Any) -> serializers.CharField:
    return StrictCharField(
        max_length=IDENTIFIER_LENGTH, validators=[IDENTIFIER], trim_whitespace=False, **kwargs
    )


def check_json_value(value: Any) -> None:
    """Depth, I-JSON number and NUL limits, naming the first offending path."""
    max_depth = settings.LEDGER_MAX_JSON_DEPTH
    stack: list[tuple[Any, str, int]] = [(value, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > max_depth:
            raise serializers.ValidationError(f"{path}: nested deeper than {max_depth} levels.")
        if isinstance(node, dict):
            for key in node:
                if "\x00" in key:
                    raise serializers.ValidationError(f"{path}: a key holds U+0000 (NUL).")
            stack.extend((item, f"{path}.{key}", depth + 1) for key, item in node.items())
        elif isinstance(node, str):
            if "\x00" in node:
                # PostgreSQL's jsonb cannot store it; refuse before anything is written.
                raise serializers.ValidationError(f"{path}: U+0000 (NUL) is not allowed.")
        elif isinstance(node, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node))
        elif (
            isinstance(node, int)
            and not isinstance(node, bool)
            and abs(node) > chain.MAX_SAFE_INTEGER
        ):
            raise serializers.ValidationError(
                f"{path}: integers beyond ±2^53-1 lose precision; send them as strings."
            )


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not know, naming each."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = set(data) - set(self.fields)
            if unknown:
                raise serializers.ValidationError(
                    {name: ["Unknown field."] for name in sorted(unknown)}
                )
        return super().to_internal_value(data)


class JSONValueField(serializers.JSONField):
    def to_internal_value(self, data: Any) -> Any:
        check_json_value(data)
        return data


class IntentSerializer(StrictSerializer):
    invocation_id = identifier()
    task_id = identifier()
    capability = StrictCharField(max_length=160, validators=[SCOPE])
    subject = StrictCharField(
        max_length=256, required=False, allow_blank=True, validators=[PRINTABLE]
    )
    arguments = JSONValueField(required=False)
    arguments_digest = StrictCharField(required=False, validators=[DIGEST])
    idempotency_key = StrictCharField(max_length=256, validators=[PRINTABLE], trim_whitespace=False)
    approval = serializers.DictField(required=False)
    traceparent = StrictCharField(required=False, validators=[TRACEPARENT])
    attempt_id = identifier(required=False)
    requested_at = serializers.DateTimeField(required=False)

    def validate_approval(self, value: dict[str, Any]) -> dict[str, Any]:
        check_json_value(value)
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "arguments" in attrs:
            try:
                digest = chain.digest(attrs["arguments"])
            except chain.CanonicalizationError as exc:
                raise serializers.ValidationError({"arguments": [str(exc)]}) from None
            sent = attrs.get("arguments_digest")
            if sent is not None and sent != digest:
                raise serializers.ValidationError(
                    {"arguments_digest": [f"Does not match the arguments ({digest})."]}
                )
            attrs["arguments_digest"] = digest
        elif "arguments_digest" not in attrs:
            raise serializers.ValidationError(
                {"arguments": ["Send the arguments, or at least their arguments_digest."]}
            )
        if not attrs["idempotency_key"]:
            raise serializers.ValidationError({"idempotency_key": ["May not be empty."]})
        return attrs

    def to_input(self, data: dict[str, Any]) -> IntentInput:
        return IntentInput(
            invocation_id=data["invocation_id"],
            task_id=data["task_id"],
            capability=data["capability"],
            idempotency_key=data["idempotency_key"],
            subject=data.get("subject", ""),
            arguments=data.get("arguments"),
            has_arguments="arguments" in data,
            arguments_digest=data.get("arguments_digest"),
            approval=data.get("approval"),
            traceparent=data.get("traceparent", ""),
            attempt_id=data.get("attempt_id"),
            requested_at=data.get("requested_at"),
        )


class AttemptSerializer(StrictSerializer):
    attempt_id = identifier()

    def to_input(self, data: dict[str, Any], invocation_id: str) -> AttemptInput:
        return AttemptInput(invocation_id=invocation_id, attempt_id=data["attempt_id"])


class ErrorDetailSerializer(StrictSerializer):
    code = StrictCharField(max_length=128, required=False, validators=[PRINTABLE])
    message = StrictCharField(max_length=4000, required=False)


class OutcomeSerializer(StrictSerializer):
    kind = serializers.ChoiceField(choices=[k.value for k in policy.OutcomeKind])
    retryable = StrictBooleanField(required=False, default=False)
    business_reference = StrictCharField(max_length=256, required=False, validators=[PRINTABLE])
    result = JSONValueField(required=False)
    error = ErrorDetailSerializer(required=False)
    completed_at = serializers.DateTimeField(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "result" in attrs:
            try:
                attrs["result_digest"] = chain.digest(attrs["result"])
            except chain.CanonicalizationError as exc:
                raise serializers.ValidationError({"result": [str(exc)]}) from None
        if attrs.get("retryable") and attrs["kind"] != policy.OutcomeKind.BUSINESS_FAILED:
            raise serializers.ValidationError(
                {"retryable": ["Only a business_failed outcome carries retryable."]}
            )
        return attrs

    def to_input(self, data: dict[str, Any], invocation_id: str, attempt_id: str) -> OutcomeInput:
        error = data.get("error") or {}
        return OutcomeInput(
            invocation_id=invocation_id,
            attempt_id=attempt_id,
            kind=policy.OutcomeKind(data["kind"]),
            retryable=data.get("retryable", False),
            business_reference=data.get("business_reference", ""),
            result=data.get("result"),
            result_digest=data.get("result_digest", ""),
            error_code=error.get("code", ""),
            error_message=error.get("message", ""),
            completed_at=data.get("completed_at"),
        )


# Batch items: the single call's body plus `type` (and the ids the URL carries).


class AttemptItemSerializer(AttemptSerializer):
    type = serializers.ChoiceField(choices=["attempt"])
    invocation_id = identifier()

    def item_input(self, data: dict[str, Any]) -> AttemptInput:
        return self.to_input(data, data["invocation_id"])


class OutcomeItemSerializer(OutcomeSerializer):
    type = serializers.ChoiceField(choices=["outcome"])
    invocation_id = identifier()
    attempt_id = identifier()

    def item_input(self, data: dict[str, Any]) -> OutcomeInput:
        return self.to_input(data, data["invocation_id"], data["attempt_id"])


class IntentItemSerializer(IntentSerializer):
    type = serializers.ChoiceField(choices=["intent"])

    def item_input(self, data: dict[str, Any]) -> IntentInput:
        return self.to_input(data)


# Response shapes, for the schema.


class StateSerializer(serializers.Serializer):
    invocation_id = serializers.CharField()
    status = serializers.ChoiceField(choices=[s.value for s in policy.Status])
    failure_class = serializers.ChoiceField(
        choices=[k.value for k in policy.OutcomeKind], allow_null=True
    )
    cause = serializers.ChoiceField(choices=[c.value for c in policy.Cause], allow_null=True)
    retryable = serializers.BooleanField()
    reconciliation_required = serializers.BooleanField()
    next_action = serializers.ChoiceField(choices=[a.value for a in policy.NextAction])
    flags = serializers.ListField(
        child=serializers.ChoiceField(choices=[f.value for f in policy.Flag])
    )


class ErrorBodySerializer(serializers.Serializer):
    type = serializers.CharField()
    message = serializers.CharField()
    details = serializers.DictField()


class ErrorSerializer(serializers.Serializer):
    error = ErrorBodySerializer()


class OutcomeOutSerializer(serializers.Serializer):
    kind = serializers.CharField()
    retryable = serializers.BooleanField()
    business_reference = serializers.CharField()
    result = serializers.JSONField(allow_null=True)
    result_digest = serializers.CharField()
    error_code = serializers.CharField()
    error_message = serializers.CharField()
    completed_at = serializers.DateTimeField(allow_null=True)
    recorded_at = serializers.DateTimeField()


class AttemptOutSerializer(serializers.Serializer):
    attempt_id = serializers.CharField()
    number = serializers.IntegerField()
    admitted_at = serializers.DateTimeField()
    deadline_at = serializers.DateTimeField()
    outcome = OutcomeOutSerializer(allow_null=True)


# `data` would shadow Serializer.data, so events are described by a dict of fields.
EVENT_OUT_FIELDS: dict[str, serializers.Field] = {
    "seq": serializers.IntegerField(),
    "kind": serializers.CharField(),
    "actor": serializers.CharField(),
    "data": serializers.JSONField(),
    "created_at": serializers.DateTimeField(),
    "prev_hash": serializers.CharField(),
    "hash": serializers.CharField(),
}


class InvocationDetailSerializer(StateSerializer):
    task_id = serializers.CharField()
    capability = serializers.CharField()
    subject = serializers.CharField()
    idempotency_key = serializers.CharField()
    arguments = serializers.JSONField(allow_null=True)
    arguments_digest = serializers.CharField()
    risk = serializers.CharField()
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    attempts = AttemptOutSerializer(many=True)
    events = inline_serializer("EventOut", fields=EVENT_OUT_FIELDS, many=True)


class InvocationPageSerializer(serializers.Serializer):
    results = StateSerializer(many=True)
    next = serializers.URLField(allow_null=True)


class BatchResultSerializer(serializers.Serializer):
    status = serializers.IntegerField()
    body = serializers.JSONField()


class BatchResponseSerializer(serializers.Serializer):
    results = BatchResultSerializer(many=True)
