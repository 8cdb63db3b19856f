"""The runtime API (DESIGN section 5): one APIView per operation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.authentication import (
    BaseAuthentication,
    BasicAuthentication,
    SessionAuthentication,
)
from rest_framework.exceptions import AuthenticationFailed, NotFound, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.permissions import IsAdminUser
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ledger import acc, policy, services, store
from ledger.api import inputs
from ledger.api import serializers as s
from ledger.api.authentication import UNKNOWN_OR_REVOKED, RuntimeTokenAuthentication
from ledger.api.errors import error_body, exception_handler
from ledger.capabilities import Registered, capability_register
from ledger.models import Invocation, Runtime, RuntimeToken
from ledger.services import Applied, LedgerError

ERRORS = {
    code: OpenApiResponse(s.ErrorSerializer, description=description)
    for code, description in {
        400: "malformed_request / validation_failed",
        401: "unauthenticated",
        404: "not_found",
        409: "intent_conflict / idempotency_key_in_use / attempt_refused / "
        "attempt_in_flight / outcome_conflict",
        413: "payload_too_large",
        415: "unsupported_media_type: a body that is not JSON, or is compressed",
        422: "capability_disabled / subject_required",
        429: "rate_limited: the token's request rate, or (on an admission) its capability's "
        "enforced execution.rate_limit, whose details name the capability; nothing was "
        "recorded, send the same request after Retry-After",
        500: "internal_error: the ledger failed, safe to resend / projection_broken: the "
        "invocation's record was changed outside the ledger, nothing was recorded",
        503: "ledger_unavailable: nothing was recorded, safe to resend",
    }.items()
}


def errors(*codes: int) -> dict[int, OpenApiResponse]:
    """The typed errors an endpoint answers, with the 500 that any of them can."""
    return {code: ERRORS[code] for code in (*codes, 500)}


def runtime_of(request: Request) -> Runtime:
    """The authenticated runtime (RuntimeTokenAuthentication puts it in request.user)."""
    runtime = request.user
    assert isinstance(runtime, Runtime)
    return runtime


def written(applied: Applied) -> Response:
    return Response(applied.state, status=201 if applied.created else 200)


def valid_path_id(value: str) -> str:
    """A path id that could never have been stored is simply not found."""
    if len(value) > inputs.IDENTIFIER_LENGTH or inputs.IDENTIFIER_PATTERN.match(value) is None:
        raise NotFound("no such invocation")
    return value


class JSONAlways(DefaultContentNegotiation):
    """The runtime API answers JSON, whatever the Accept header asks for.

    DRF's negotiation parses Accept into media types on every request to choose
    among renderers (0.1 ms, a twentieth of an intent's Python); these views have
    one. The request body's Content-Type is still checked: a form body gets 415.
    """

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        renderer = next(iter(renderers))
        return renderer, renderer.media_type


class RuntimeAPIView(APIView):
    """A view of the runtime API: JSON in and out."""

    content_negotiation_class = JSONAlways


class StatementConfirmedView(RuntimeAPIView):
    """A runtime API view whose every statement confirms the token it was given.

    Its requests authenticate with a token this process remembers without reading it
    (RuntimeTokenAuthentication with `remember`); each of its statements is passed
    `runtime.unconfirmed_token_id`, checks in the database that the token is still
    unrevoked, and clears it. A request that ends with the token unconfirmed (before
    any statement: a 400, a 404 of a malformed id, a 429) has it read before answering.
    """

    runtime: Runtime | None = None
    token: RuntimeToken | None = None

    def get_authenticators(self) -> list[BaseAuthentication]:
        return [RuntimeTokenAuthentication(remember=True)]

    def perform_authentication(self, request: Request) -> None:
        if isinstance(request.user, Runtime) and isinstance(request.auth, RuntimeToken):
            self.runtime, self.token = request.user, request.auth

    def handle_exception(self, exc: Exception) -> Response:
        if isinstance(exc, store.TokenRevoked):
            exc = self.revoked()
        return super().handle_exception(exc)

    def finalize_response(
        self, request: Request, response: Response, *args: Any, **kwargs: Any
    ) -> Response:
        runtime, token = self.runtime, self.token
        if runtime is not None and token is not None and runtime.unconfirmed_token_id:
            try:
                active = store.active_token(token.prefix)
            except DatabaseError as error:
                response = self.handle_exception(error)
            else:
                runtime.unconfirmed_token_id = None
                if active is None or active.pk != token.pk:
                    response = self.handle_exception(self.revoked())
        return super().finalize_response(request, response, *args, **kwargs)

    def revoked(self) -> AuthenticationFailed:
        assert self.runtime is not None and self.token is not None
        self.runtime.unconfirmed_token_id = None
        RuntimeTokenAuthentication.forget(self.token.prefix)
        return AuthenticationFailed(UNKNOWN_OR_REVOKED)


WRITE_RESPONSES = {
    201: OpenApiResponse(s.StateSerializer, description="recorded"),
    200: OpenApiResponse(s.StateSerializer, description="idempotent replay: already recorded"),
}


class IntentView(StatementConfirmedView):
    @extend_schema(
        operation_id="record_intent",
        request={"application/json": inputs.INTENT_SCHEMA},
        responses={**WRITE_RESPONSES, **errors(400, 401, 409, 413, 415, 422, 429, 503)},
        summary="Record the write-ahead intent (and, with attempt_id, admit the first attempt)",
    )
    def post(self, request: Request) -> Response:
        intent = inputs.intent(request.data)
        return written(services.record_intent(runtime=runtime_of(request), intent=intent))


class AttemptView(StatementConfirmedView):
    @extend_schema(
        operation_id="admit_attempt",
        request={"application/json": inputs.ATTEMPT_SCHEMA},
        responses={**WRITE_RESPONSES, **errors(400, 401, 404, 409, 413, 415, 429, 503)},
        summary="Ask admission for a new transport attempt",
    )
    def post(self, request: Request, invocation_id: str) -> Response:
        attempt = inputs.attempt(request.data, valid_path_id(invocation_id))
        return written(
            services.admit_attempt(
                runtime=runtime_of(request),
                invocation_id=attempt.invocation_id,
                attempt_id=attempt.attempt_id,
            )
        )


class OutcomeView(StatementConfirmedView):
    @extend_schema(
        operation_id="record_outcome",
        request={"application/json": inputs.OUTCOME_SCHEMA},
        responses={**WRITE_RESPONSES, **errors(400, 401, 404, 409, 413, 415, 429, 503)},
        summary="Report an attempt's outcome",
    )
    def post(self, request: Request, invocation_id: str, attempt_id: str) -> Response:
        outcome = inputs.outcome(
            request.data, valid_path_id(invocation_id), valid_path_id(attempt_id)
        )
        return written(services.record_outcome(runtime=runtime_of(request), outcome=outcome))


def detail_body(found: store.Detail) -> dict[str, Any]:
    invocation = found.invocation
    attempts = []
    for attempt, outcome in found.attempts:
        attempts.append(
            {
                "attempt_id": attempt.attempt_id,
                "number": attempt.number,
                "admitted_at": attempt.admitted_at,
                "deadline_at": attempt.deadline_at,
                "outcome": None
                if outcome is None
                else {
                    "kind": outcome.kind,
                    "retryable": outcome.retryable,
                    "business_reference": outcome.business_reference,
                    "result": outcome.result,
                    "result_digest": outcome.result_digest,
                    "error_code": outcome.error_code,
                    "error_message": outcome.error_message,
                    "completed_at": outcome.completed_at,
                    "recorded_at": outcome.recorded_at,
                },
            }
        )
    return {
        **services.typed_state(invocation),
        "task_id": invocation.task_id,
        "capability": invocation.capability_scope,
        "subject": invocation.subject,
        "idempotency_key": invocation.idempotency_key,
        "arguments": invocation.arguments,
        "arguments_digest": invocation.arguments_digest,
        "risk": invocation.risk_level,
        "created_at": invocation.created_at,
        "updated_at": invocation.updated_at,
        "attempts": attempts,
        "events": [
            {
                "seq": e.seq,
                "kind": e.kind,
                "actor": e.actor,
                "data": e.data,
                "created_at": e.created_at,
                "prev_hash": e.prev_hash,
                "hash": e.hash,
            }
            for e in found.events
        ],
    }


class InvocationDetailView(StatementConfirmedView):
    @extend_schema(
        operation_id="get_invocation",
        responses={200: s.InvocationDetailSerializer, **errors(401, 404, 429, 503)},
        summary="State, retry decision, attempts and events of one invocation",
    )
    def get(self, request: Request, invocation_id: str) -> Response:
        found = services.invocation_detail(
            runtime=runtime_of(request), invocation_id=valid_path_id(invocation_id)
        )
        if found is None:
            raise NotFound("no such invocation")
        return Response(detail_body(found))


class ListQuerySerializer(s.StrictSerializer):
    task_id = s.identifier(required=False)
    status = serializers.ChoiceField(choices=[st.value for st in policy.Status], required=False)
    after = serializers.IntegerField(
        required=False, min_value=0, help_text="the cursor from `next`"
    )
    limit = serializers.IntegerField(required=False, min_value=1, max_value=500, default=50)


class InvocationListView(RuntimeAPIView):
    @extend_schema(
        operation_id="list_invocations",
        parameters=[ListQuerySerializer],
        responses={200: s.InvocationPageSerializer, **errors(400, 401, 429, 503)},
        summary="The runtime's own invocations, newest last, keyset-paginated",
    )
    def get(self, request: Request) -> Response:
        query = ListQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        params = query.validated_data
        rows = Invocation.objects.for_runtime(runtime_of(request)).order_by("id")
        if "task_id" in params:
            rows = rows.filter(task_id=params["task_id"])
        if "status" in params:
            rows = rows.filter(status=params["status"])
        if "after" in params:
            rows = rows.filter(id__gt=params["after"])
        page = list(services.with_heads(rows)[: params["limit"] + 1])
        more = len(page) > params["limit"]
        page = page[: params["limit"]]
        services.refuse_rows_disagreeing(page, runtime_of(request))
        next_url = None
        if more:
            cursor = request.query_params.copy()
            cursor["after"] = str(page[-1].pk)
            next_url = request.build_absolute_uri(f"{request.path}?{cursor.urlencode()}")
        return Response({"results": [services.typed_state(row) for row in page], "next": next_url})


class EvidenceView(StatementConfirmedView):
    max_body_bytes = settings.LEDGER_MAX_BATCH_BODY_BYTES

    @extend_schema(
        operation_id="record_evidence_batch",
        request={"application/json": inputs.BATCH_SCHEMA},
        responses={207: s.BatchResponseSerializer, **errors(400, 401, 413, 415, 429, 503)},
        summary="Apply up to 1,000 intents, attempts and outcomes in order",
        description=(
            "Each item is the body of a single call plus `type` (`intent`, `attempt` or "
            "`outcome`) and, for attempts and outcomes, `invocation_id` and `attempt_id`. "
            "Each result is the status and body that single call would have returned."
        ),
    )
    def post(self, request: Request) -> Response:
        items = request.data
        if not isinstance(items, list):
            raise ValidationError({"non_field_errors": ["Expected a JSON array of items."]})
        limit = settings.LEDGER_MAX_BATCH_ITEMS
        if len(items) > limit:
            raise ValidationError({"items": [f"At most {limit} items per batch."]})
        # Invalid items get their 400 in place; the valid ones are applied in order.
        results: list[tuple[int, Any] | None] = []
        valid: list[services.EvidenceInput] = []
        for raw in items:
            try:
                valid.append(inputs.item(raw))
                results.append(None)
            except ValidationError as exc:
                results.append((400, validation_body(exc)))
        applied = iter(
            services.apply_evidence(runtime=runtime_of(request), items=valid) if valid else []
        )
        body = []
        for result in results:
            if result is None:
                outcome = next(applied)
                if isinstance(outcome, LedgerError):
                    result = (
                        outcome.status,
                        error_body(outcome.type, outcome.message, outcome.details),
                    )
                else:
                    result = (201 if outcome.created else 200, outcome.state)
            body.append({"status": result[0], "body": result[1]})
        return Response({"results": body}, status=207)


def validation_body(exc: ValidationError) -> dict[str, Any]:
    response = exception_handler(exc, {})
    assert response is not None
    return response.data  # type: ignore[no-any-return]


@extend_schema_field(
    {"type": "object", "additionalProperties": True, "description": "An ACC v1 declaration."}
)
class DeclarationField(s.JSONValueField):
    """A declaration is a JSON object (the schema said any JSON, null included)."""


class DeclarationSerializer(s.StrictSerializer):
    declaration = DeclarationField()
    http_method = serializers.ChoiceField(
        choices=[m.upper() for m in acc.HTTP_METHODS], required=False
    )


class CapabilityOutSerializer(serializers.Serializer):
    scope = serializers.CharField()
    version = serializers.IntegerField()
    outcome = serializers.ChoiceField(choices=[r.value for r in Registered])
    enabled = serializers.BooleanField()
    risk = serializers.CharField()
    readonly = serializers.BooleanField()
    audit_sensitive = serializers.BooleanField()


class CapabilityView(RuntimeAPIView):
    """Administrators post ACC declarations directly (runtimes' tokens cannot)."""

    authentication_classes = [BasicAuthentication, SessionAuthentication]
    permission_classes = [IsAdminUser]
    throttle_classes: list[type] = []

    @extend_schema(
        operation_id="register_capability",
        request=DeclarationSerializer,
        responses={
            201: CapabilityOutSerializer,
            200: CapabilityOutSerializer,
            **errors(400, 401, 415),
            403: OpenApiResponse(s.ErrorSerializer, description="not an administrator"),
        },
        summary="Register or update a capability from its ACC v1 declaration (admins)",
    )
    def post(self, request: Request) -> Response:
        data = DeclarationSerializer().run_validation(request.data)
        try:
            declaration = acc.parse(data["declaration"], http_method=data.get("http_method"))
        except acc.InvalidDeclaration as invalid:
            raise LedgerError(
                "validation_failed",
                "The declaration is not a valid ACC v1 declaration; nothing was registered.",
                status=400,
                details={"diagnostic": invalid.diagnostic.value, "reason": invalid.reason},
            ) from None
        registration = capability_register(
            declaration=declaration, source="api", actor=f"user:{request.user.get_username()}"
        )
        capability = registration.capability
        body = {
            "scope": capability.scope,
            "version": capability.version,
            "outcome": registration.outcome.value,
            "enabled": capability.enabled,
            "risk": capability.risk_level,
            "readonly": capability.readonly,
            "audit_sensitive": capability.audit_sensitive,
        }
        return Response(body, status=201 if registration.outcome is Registered.CREATED else 200)
