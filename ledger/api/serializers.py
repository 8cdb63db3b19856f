"""The documented response shapes of the runtime API, and the few DRF inputs left.

Write bodies are msgspec structs (`ledger/api/inputs.py`). Responses are built by
the services as dicts (the hot path does no serializer work on the way out); the
output serializers here only describe them for the OpenAPI schema. The list query
and the administrators' declaration upload stay DRF serializers.
"""

from __future__ import annotations

from typing import Any

from django.core.validators import RegexValidator
from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

from ledger import policy
from ledger.api.inputs import IDENTIFIER_LENGTH, IDENTIFIER_PATTERN, PATTERN_HINTS, check_json_value

IDENTIFIER = RegexValidator(
    IDENTIFIER_PATTERN, PATTERN_HINTS[IDENTIFIER_PATTERN.pattern], code="invalid_identifier"
)


class StrictCharField(serializers.CharField):
    """A JSON string only: DRF would turn 7 into "7", hiding a runtime's bug."""

    default_error_messages = {"invalid": "Must be a string."}

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


def identifier(**kwargs: Any) -> serializers.CharField:
    return StrictCharField(
        max_length=IDENTIFIER_LENGTH, validators=[IDENTIFIER], trim_whitespace=False, **kwargs
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
        child=serializers.ChoiceField(choices=[f.value for f in policy.Flag]),
        help_text=(
            "What compliance will see about the invocation. Flags inform: the retry "
            "decision is status, retryable and next_action. "
            + " ".join(
                f"{flag.value}: {meaning}." for flag, meaning in policy.FLAG_MEANINGS.items()
            )
            + " The ledger's rate watch sets rate_limit_exceeded within minutes of the "
            "admission, and its reference watch sets reference_shared within minutes of "
            "a later invocation's evidence naming the same business reference, so a later "
            "read may show them."
        ),
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
