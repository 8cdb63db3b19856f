from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import logging
import re
import secrets
from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.validators import RegexValidator
from django.db import connection, models, transaction
from django.db.models import Case, F, FilteredRelation, Q, When
from django.db.models.fields.json import KeyTransform
from django.utils import timezone

from ledger import policy
from ledger.chain import GENESIS_HASH, REDACTED, SECRET_KEY_PATTERN, event_hash, redact
from ledger.identifiers import IDENTIFIER_HINT, IDENTIFIER_REGEX
from ledger.probe_config import validate_probe_config

if TYPE_CHECKING:
    from datetime import datetime

log = logging.getLogger(__name__)

# What RuntimeToken.issue makes: secrets.token_hex(6).
TOKEN_PREFIX = re.compile(r"[0-9a-f]{12}")


class Capability(models.Model):
    """A governed operation, identified by its ACC `scope` (e.g. `refund.create`)."""

    class Risk(models.TextChoices):
        LOW = "low"
        MEDIUM = "medium"
        HIGH = "high"

    scope = models.CharField(max_length=160, unique=True)
    enabled = models.BooleanField(default=True)
    readonly = models.BooleanField(default=False)
    idempotent = models.BooleanField(default=False)
    # Admin-set: the business system enforces the idempotency key atomically. A
    # declared `idempotent: true` alone never makes a post-dispatch failure retryable.
    idempotency_verified = models.BooleanField(default=False)
    risk_level = models.CharField(max_length=8, choices=Risk.choices, default=Risk.MEDIUM)
    subject_required = models.BooleanField(default=False)
    audit_sensitive = models.BooleanField(default=False)
    timeout_ms = models.PositiveIntegerField(null=True, blank=True)
    grace_ms = models.PositiveIntegerField(null=True, blank=True)
    max_attempts = models.PositiveSmallIntegerField(null=True, blank=True)
    # Admin-set: an attempt beyond the declared `execution.rate_limit` is refused at
    # admission (429), not only flagged by the rate watch (`ledger.rate_limits`).
    rate_limit_enforced = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Refuse an attempt beyond the declared execution.rate_limit (429, nothing "
        "recorded), instead of admitting it and flagging its invocation rate_limit_exceeded.",
    )
    # Argument paths (dotted) masked in the stored copy, on top of secret-looking keys.
    redact_paths = ArrayField(models.CharField(max_length=200), default=list, blank=True)
    # How reconciliation asks the business system what happened (README: probes).
    probe = models.JSONField(default=dict, blank=True, validators=[validate_probe_config])
    # The ACC declaration in force, and its version (1, 2, …; 0: none imported yet).
    # The fields above that ACC defines are derived from it by the registry.
    declaration = models.JSONField(default=dict, blank=True)
    version = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "capabilities"
        constraints = [
            models.CheckConstraint(
                condition=Q(max_attempts__isnull=True) | Q(max_attempts__gte=1),
                name="capability_max_attempts_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.scope

    @property
    def has_probe(self) -> bool:
        """Whether reconciliation can ask the business system (kind other than none)."""
        return self.probe.get("kind", "none") != "none"

    def hints(self) -> policy.Hints:
        return policy.Hints(
            readonly=self.readonly,
            idempotency_verified=self.idempotency_verified,
            max_attempts=self.max_attempts or settings.LEDGER_DEFAULT_MAX_ATTEMPTS,
        )


class CapabilityDeclaration(models.Model):
    """Every ACC declaration a capability ever had; never changed once written."""

    capability = models.ForeignKey(
        Capability, on_delete=models.PROTECT, related_name="declarations"
    )
    version = models.PositiveIntegerField()
    declaration = models.JSONField()
    source = models.CharField(max_length=200)
    actor = models.CharField(max_length=160)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["capability", "version"], name="capability_declaration_version_unique"
            ),
        ]
        ordering = ["capability", "-version"]

    def __str__(self) -> str:
        return f"{self.capability} v{self.version}"


class Runtime(models.Model):
    """An agent runtime or gateway that posts evidence with its own tokens."""

    # The name is written into every event it records (`runtime:<name>`), into logs and
    # exports: no blanks, control characters or terminal escapes.
    name = models.CharField(
        max_length=100,
        unique=True,
        validators=[RegexValidator(IDENTIFIER_REGEX, IDENTIFIER_HINT)],
    )
    created_at = models.DateTimeField(default=timezone.now)

    # DRF's IsAuthenticated asks the authenticated principal this.
    is_authenticated = True
    # Per request: the token this web process remembered rather than read again, until
    # one of the request's statements confirms it is still unrevoked
    # (ledger/api/authentication.py).
    unconfirmed_token_id: int | None = None

    def __str__(self) -> str:
        return self.name


class RuntimeTokenQuerySet(models.QuerySet["RuntimeToken"]):
    def active(self) -> RuntimeTokenQuerySet:
        return self.filter(revoked_at__isnull=True)


class RuntimeToken(models.Model):
    """A bearer token: `ilr_<prefix>_<secret>`, stored as a SHA-256 of the whole token.

    The prefix is stored in clear to find the row; the secret is shown once.
    SHA-256 (not a slow KDF) is right here: the secret is 256 random bits, so there
    is nothing to brute-force, and every API request pays for the check.
    """

    PREFIX = "ilr"

    runtime = models.ForeignKey(Runtime, on_delete=models.PROTECT, related_name="tokens")
    prefix = models.CharField(max_length=16, unique=True)
    digest = models.CharField(max_length=64)
    label = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = RuntimeTokenQuerySet.as_manager()

    def __str__(self) -> str:
        return f"{self.PREFIX}_{self.prefix}_… ({self.runtime})"

    @staticmethod
    def hash(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    @classmethod
    def issue(cls, *, runtime: Runtime, label: str = "") -> tuple[RuntimeToken, str]:
        prefix = secrets.token_hex(6)
        token = f"{cls.PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
        row = cls.objects.create(
            runtime=runtime, prefix=prefix, digest=cls.hash(token), label=label
        )
        return row, token

    @classmethod
    def issue_logged(
        cls, *, runtime: Runtime, actor: str, label: str = ""
    ) -> tuple[RuntimeToken, str]:
        """A new token, with an entry in the audit trail's action log (as `revoke`)."""
        with transaction.atomic():
            row, token = cls.issue(runtime=runtime, label=label)
            AdminAction.record(
                actor=actor,
                action="token_issued",
                target=f"runtime {runtime.name}, token {row.prefix}",
                reason=label,
            )
        return row, token

    @staticmethod
    def split(token: str) -> str | None:
        """The lookup prefix of a well-formed token (12 hex digits), else None.

        Nothing else reaches the query: a NUL in a forged header made a 500 there.
        """
        parts = token.split("_", 2)
        if len(parts) != 3 or parts[0] != RuntimeToken.PREFIX or not parts[2]:
            return None
        return parts[1] if TOKEN_PREFIX.fullmatch(parts[1]) else None

    def matches(self, token: str) -> bool:
        return hmac.compare_digest(self.digest, self.hash(token))

    def revoke(self, *, actor: str, reason: str = "") -> bool:
        """Revoke it, with an entry in the audit trail's action log; False if it was
        already revoked. Web processes refuse it from their next statement on."""
        with transaction.atomic():
            revoked = RuntimeToken.objects.filter(pk=self.pk, revoked_at__isnull=True).update(
                revoked_at=timezone.now()
            )
            if revoked:
                AdminAction.record(
                    actor=actor,
                    action="token_revoked",
                    target=f"runtime {self.runtime.name}, token {self.prefix}",
                    reason=reason,
                )
        return bool(revoked)


# The reconciliation queue's order, riskiest first; an unknown risk level counts as the
# lowest. RISK_FIRST says it in SQL, which the queue sorts by and invocation_queue_order
# holds.
RISK_RANK: dict[str, int] = {
    Capability.Risk.HIGH.value: 0,
    Capability.Risk.MEDIUM.value: 1,
    Capability.Risk.LOW.value: 2,
}
MAX_RISK_RANK = max(RISK_RANK.values())
RISK_FIRST = Case(
    *[When(risk_level=level, then=rank) for level, rank in RISK_RANK.items()],
    default=MAX_RISK_RANK,
)
QUEUE_ORDER = (RISK_FIRST, F("flagged_at"), F("id"))
FLAGGED_STATUSES = sorted(s.value for s in policy.NEEDS_RECONCILIATION)
IS_FLAGGED = Q(status__in=FLAGGED_STATUSES)
# Escalated for want of a probe, or because the probe could not tell, and nobody on it:
# what a probe added since, or answering again, may settle. (A conflict of evidence or a
# shared reference is a person's to decide, whatever a probe finds.)
PROBE_COULD_SETTLE = (policy.Cause.NO_PROBE.value, policy.Cause.PROBE_INCONCLUSIVE.value)
AWAITS_A_PROBE = Q(status=policy.Status.ESCALATED.value, cause__in=PROBE_COULD_SETTLE, assignee="")


class Row(models.Func):
    """PostgreSQL's row constructor. `Row(a, b, c) > Row(x, y, z)` compares in order, as
    a keyset page needs, and a btree index on (a, b, c) starts its scan at that row. The
    same test spelled as an OR of conditions bounds the scan by its first column only,
    so each page would read again every row of the pages before it of that rank."""

    function = "ROW"
    output_field = models.Field()


class InvocationQuerySet(models.QuerySet["Invocation"]):
    def for_runtime(self, runtime: Runtime) -> InvocationQuerySet:
        return self.filter(runtime=runtime)

    def of_runtime_named(self, name: str) -> InvocationQuerySet:
        """The invocations of the runtime called `name`, said of its id, looked up
        first. Across a join, PostgreSQL guessed the runtime's share of the rows rather
        than reading it from the column's statistics, and could not read them from an
        index that starts with the runtime in that index's order."""
        runtime_id = Runtime.objects.filter(name=name).values_list("pk", flat=True).first()
        return self.none() if runtime_id is None else self.filter(runtime_id=runtime_id)

    def flagged(self) -> InvocationQuerySet:
        return self.filter(IS_FLAGGED)

    def awaiting_probe_of(self, capability: Capability) -> InvocationQuerySet:
        """The capability's escalations its probe could settle now (`AWAITS_A_PROBE`,
        through its index), those recorded before it was declared too (`probed_by`)."""
        return self.filter(AWAITS_A_PROBE, capability_scope=capability.scope)

    def counted_up_to(self, limit: int) -> tuple[int, bool]:
        """How many, counting no further than `limit`; and whether there are more."""
        n = self[: limit + 1].count()
        return min(n, limit), n > limit

    def overdue(self, now: datetime) -> InvocationQuerySet:
        return self.filter(status=policy.Status.IN_FLIGHT, deadline_at__lte=now)

    def due_for_probe(self, now: datetime) -> InvocationQuerySet:
        return self.filter(status=policy.Status.RECONCILIATION_REQUIRED).filter(
            Q(next_probe_at__isnull=True) | Q(next_probe_at__lte=now)
        )

    def lease_expired(self, now: datetime) -> InvocationQuerySet:
        return self.filter(status=policy.Status.RECONCILING, lease_expires_at__lte=now)

    def lease_running(self, now: datetime) -> InvocationQuerySet:
        return self.filter(status=policy.Status.RECONCILING, lease_expires_at__gt=now)


# The columns fixed at intent time that the intent's event records, and where in its
# data: a row edited there would decide retries (the hints), two-person approval (the
# risk) or which business intent it is on what no event says.
RECORDED_AT_INTENT: dict[str, tuple[str, ...]] = {
    "task_id": ("task_id",),
    "capability_scope": ("capability",),
    "capability_version": ("capability_version",),
    "subject": ("subject",),
    "idempotency_key": ("idempotency_key",),
    "arguments_digest": ("arguments_digest",),
    "hint_readonly": ("hints", "readonly"),
    "hint_idempotency_verified": ("hints", "idempotency_verified"),
    "max_attempts": ("hints", "max_attempts"),
    "risk_level": ("hints", "risk"),
}
_NOT_RECORDED = object()


class Invocation(models.Model):
    """One governed invocation: the intent, plus its current state as a projection.

    Everything here except the projection fields is fixed at intent time. The
    projection (status … head_hash) is rebuilt from the event chain and only ever
    changes in the same transaction that appends the event explaining the change.
    """

    invocation_id = models.CharField(max_length=128)
    # Indexed through invocation_runtime_task; a capability is never deleted while
    # invocations refer to it, so its own index would only slow every intent down.
    runtime = models.ForeignKey(
        Runtime, on_delete=models.PROTECT, related_name="invocations", db_index=False
    )
    task_id = models.CharField(max_length=128)
    capability = models.ForeignKey(
        Capability,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="invocations",
        db_index=False,
    )
    capability_scope = models.CharField(max_length=160)
    # The declaration version that governed this invocation (None: undeclared).
    capability_version = models.PositiveIntegerField(null=True, blank=True)
    subject = models.CharField(max_length=256, blank=True)
    idempotency_key = models.CharField(max_length=256)
    # Never the raw arguments: a copy with secret-looking keys and the capability's
    # listed paths masked (every value, for audit.sensitive ones with no list).
    # None when the runtime sent only the digest.
    arguments = models.JSONField(null=True, blank=True)
    arguments_digest = models.CharField(max_length=71)
    approval = models.JSONField(null=True, blank=True)
    traceparent = models.CharField(max_length=55, blank=True)
    requested_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Policy hints as they were when the intent was recorded.
    hint_readonly = models.BooleanField()
    hint_idempotency_verified = models.BooleanField()
    max_attempts = models.PositiveSmallIntegerField()
    timeout_ms = models.PositiveIntegerField()
    grace_ms = models.PositiveIntegerField()
    risk_level = models.CharField(max_length=8, choices=Capability.Risk.choices)

    # The projection.
    status = models.CharField(max_length=32, choices=[(s.value, s.value) for s in policy.Status])
    failure_class = models.CharField(max_length=40, blank=True)
    cause = models.CharField(max_length=40, blank=True)
    resolution = models.CharField(max_length=20, blank=True)
    flags = ArrayField(models.CharField(max_length=40), default=list, blank=True)
    attempt_count = models.PositiveSmallIntegerField(default=0)
    in_flight_attempt = models.CharField(max_length=128, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    event_count = models.PositiveIntegerField(default=0)
    head_hash = models.CharField(max_length=64)
    updated_at = models.DateTimeField(default=timezone.now)
    # When it last came to need reconciliation; None while it does not. Claims, probe
    # tries and proposals keep it, so the queue's age is the wait, not the last touch.
    flagged_at = models.DateTimeField(null=True, blank=True)
    # Reconciliation's bookkeeping, part of the projection too.
    # Database defaults too, so rows written in bulk by SQL (COPY) need not name them.
    lease_owner = models.CharField(max_length=160, blank=True, default="", db_default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    probe_tries = models.PositiveSmallIntegerField(default=0, db_default=0)
    next_probe_at = models.DateTimeField(null=True, blank=True)
    # A person's resolution waiting for a second person: effect, reference, note, by.
    proposal = models.JSONField(null=True, blank=True)
    # The operator working on it ("I'm on it"), so two people do not.
    assignee = models.CharField(max_length=150, blank=True, default="", db_default="")

    objects = InvocationQuerySet.as_manager()

    class Meta:
        constraints = [
            # A constraint, not unique=True, which would add a second (LIKE) index.
            models.UniqueConstraint(fields=["invocation_id"], name="invocation_id_unique"),
            # One business intent per (capability, idempotency key), across runtimes.
            models.UniqueConstraint(
                fields=["capability_scope", "idempotency_key"], name="invocation_scope_key_unique"
            ),
            models.CheckConstraint(
                condition=Q(
                    status=policy.Status.IN_FLIGHT.value,
                    in_flight_attempt__gt="",
                    deadline_at__isnull=False,
                )
                | (~Q(status=policy.Status.IN_FLIGHT.value) & Q(in_flight_attempt="")),
                name="invocation_in_flight_has_attempt_and_deadline",
            ),
            # The queue orders and pages by how long each has waited.
            models.CheckConstraint(
                condition=~IS_FLAGGED | Q(flagged_at__isnull=False),
                name="invocation_flagged_has_flagged_at",
            ),
        ]
        indexes = [
            # GET /api/v1/invocations?task_id=… (keyset on id within one runtime)
            models.Index(fields=["runtime", "task_id", "id"], name="invocation_runtime_task"),
            # GET /api/v1/invocations?status=… and the plain listing
            models.Index(fields=["runtime", "status", "id"], name="invocation_runtime_status"),
            # Audit search, in time order with keyset on (created_at, id): by time range
            # alone, and by the two filters too selective to find by walking time.
            models.Index(fields=["created_at", "id"], name="invocation_created"),
            models.Index(fields=["subject", "created_at", "id"], name="invocation_subject_time"),
            models.Index(fields=["task_id", "created_at", "id"], name="invocation_task_time"),
            # And by cause, which most invocations have none of (an API write of a
            # success writes none): a cause few have was found by walking every
            # invocation in time order, 133 ms at a million when none had it.
            models.Index(
                fields=["cause", "created_at", "id"],
                condition=~Q(cause=""),
                name="invocation_cause_time",
            ),
            # And by flag: each flag's invocations, in time order. A flag that few carry
            # (`evidence_conflict`) was found by walking every invocation in time order:
            # 297 ms at a million when none carried it. Partial, so a write that carries
            # no flag writes none of them.
            *[
                models.Index(
                    fields=["created_at", "id"],
                    condition=Q(flags__contains=[flag.value]),
                    name=f"flag_{flag.value}_time",
                )
                for flag in policy.Flag
            ],
            # The escalations a capability's probe could settle, which the queue offers
            # to re-run: after an outage, a few of a capability's thousands of flagged.
            models.Index(
                fields=["capability_scope", "id"],
                condition=AWAITS_A_PROBE,
                name="invocation_awaits_probe",
            ),
            # The sweeper: in-flight attempts past their deadline. Partial, so its cost
            # follows the number of in-flight invocations, not the table.
            models.Index(
                fields=["deadline_at"],
                condition=Q(status=policy.Status.IN_FLIGHT.value),
                name="invocation_in_flight_deadline",
            ),
            # The reconciler: leases that ran out (a worker died mid-probe).
            models.Index(
                fields=["lease_expires_at"],
                condition=Q(status=policy.Status.RECONCILING.value),
                name="invocation_reconciling_lease",
            ),
            # The reconciliation queue: flagged invocations by how long they waited.
            models.Index(
                fields=["flagged_at"],
                condition=IS_FLAGGED,
                name="invocation_flagged_age",
            ),
            # The queue's pages in its own order, riskiest first, then oldest: a page
            # reads a page of rows however long the queue grows (an outage can flag
            # every invocation in flight at once). With their status and capability, so
            # that the queue's live counts and the dashboard's are read from the index
            # alone.
            models.Index(
                *QUEUE_ORDER,
                condition=IS_FLAGGED,
                include=["status", "capability_scope"],
                name="invocation_queue_order",
            ),
            # The queue filtered by cause, capability, runtime or the person on it: that
            # filter's rows in the queue's order. Without them, a filter that selects a
            # few of a long queue walked all of it for a page (170 ms at 166,667).
            *[
                models.Index(
                    F(column),
                    *QUEUE_ORDER,
                    condition=IS_FLAGGED,
                    name=f"invocation_queue_by_{name}",
                )
                for column, name in [
                    ("cause", "cause"),
                    ("capability_scope", "capability"),
                    ("runtime", "runtime"),
                    ("assignee", "assignee"),
                ]
            ],
        ]

    def __str__(self) -> str:
        return self.invocation_id

    def probed_by(self) -> Capability | None:
        """The capability whose probe reconciles it: the one it was recorded under or,
        recorded undeclared, the one declared under its scope since. A probe only asks,
        by the idempotency key the runtime gave; the invocation keeps the conservative
        hints it was recorded with."""
        if self.capability_id is not None:
            return self.capability
        return Capability.objects.filter(scope=self.capability_scope).first()

    def hints(self) -> policy.Hints:
        return policy.Hints(
            readonly=self.hint_readonly,
            idempotency_verified=self.hint_idempotency_verified,
            max_attempts=self.max_attempts,
        )

    def state(self) -> policy.InvocationState:
        return policy.InvocationState.parse(
            status=self.status,
            failure_class=self.failure_class,
            cause=self.cause,
            attempts=self.attempt_count,
            in_flight_attempt=self.in_flight_attempt,
            resolution=self.resolution,
            flags=self.flags,
        )

    def differences_from(
        self, recorded: Mapping[str, Any], intent: Mapping[str, Any] | None = None
    ) -> dict[str, tuple[Any, Any]]:
        """Each column that differs from the state an event recorded, or from what the
        intent's event recorded of the columns fixed then: (recorded, found). What an
        event did not record (those of an earlier version) is not compared."""
        differences = {}
        for name in policy.RECORDED_STATE:
            if name not in recorded:
                continue
            found = getattr(self, name)
            if name in policy.BLANK_AS_NULL:
                found = found or None
            if recorded[name] != found:
                differences[name] = (recorded[name], found)
        for column, path in RECORDED_AT_INTENT.items():
            value: Any = intent or {}
            for key in path:
                value = (
                    value.get(key, _NOT_RECORDED) if isinstance(value, Mapping) else _NOT_RECORDED
                )
            if value is not _NOT_RECORDED and value != getattr(self, column):
                differences[column] = (value, getattr(self, column))
        return differences

    def apply_state(self, state: policy.InvocationState) -> None:
        self.status = state.status.value
        self.failure_class = state.failure_class.value if state.failure_class else ""
        self.cause = state.cause.value if state.cause else ""
        self.resolution = state.resolution.value if state.resolution else ""
        self.attempt_count = state.attempts
        self.in_flight_attempt = state.in_flight_attempt or ""
        self.flags = sorted(f.value for f in state.flags)
        if state.status is not policy.Status.IN_FLIGHT:
            self.deadline_at = None


class Attempt(models.Model):
    """One transport attempt; immutable once admitted."""

    # Indexed through attempt_id_unique.
    invocation = models.ForeignKey(
        Invocation, on_delete=models.PROTECT, related_name="attempts", db_index=False
    )
    attempt_id = models.CharField(max_length=128)
    number = models.PositiveSmallIntegerField()
    admitted_at = models.DateTimeField(default=timezone.now)
    deadline_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["invocation", "attempt_id"], name="attempt_id_unique"),
            models.UniqueConstraint(fields=["invocation", "number"], name="attempt_number_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.invocation_id}/{self.attempt_id}"


class Outcome(models.Model):
    """The runtime's report for one attempt; at most one, never replaced."""

    attempt = models.OneToOneField(Attempt, on_delete=models.PROTECT, related_name="outcome")
    kind = models.CharField(max_length=40, choices=[(k.value, k.value) for k in policy.OutcomeKind])
    retryable = models.BooleanField(default=False)
    business_reference = models.CharField(max_length=256, blank=True)
    # Masked like Invocation.arguments.
    result = models.JSONField(null=True, blank=True)
    result_digest = models.CharField(max_length=71, blank=True)
    error_code = models.CharField(max_length=128, blank=True)
    error_message = models.TextField(blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    recorded_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.attempt}: {self.kind}"


# The events that reopen a probe's claim (reconciliation.services): its lease ran out,
# or its worker's database session was found gone before that.
LEASE_EXPIRED = "lease_expired"
PROBE_WORKER_LOST = "probe_worker_lost"
REOPENED_CLAIM_KINDS = (LEASE_EXPIRED, PROBE_WORKER_LOST)

# An event whose data names a business reference. In jsonb's order every non-empty
# string sorts after "", so this excludes the outcomes that name none.
HAS_BUSINESS_REFERENCE = Q(data__business_reference__gt="")
# An event whose business reference other invocations' evidence names already
# (services.shared_reference_data): the reference_shared flag's events.
NAMES_A_SHARED_REFERENCE = Q(data__has_key="also_named_by") | Q(
    data__has_key="also_named_elsewhere"
)


class NamedReference(models.Model):
    """A business reference some invocation's evidence names, with the first to name it.

    The events say who names a reference; this row is where two units naming a new
    one at the same moment meet. Each inserts it; the second insert waits for the
    first unit to commit, finds the row there and fails its write, so that unit reads
    again and sees the other invocation. Without it both would read "named by no
    one", and one effect would be counted for two intents unflagged (store.write).
    """

    reference = models.TextField(primary_key=True)
    first_named_by = models.ForeignKey(
        Invocation, on_delete=models.PROTECT, related_name="+", db_index=False
    )

    def __str__(self) -> str:
        return self.reference


def events_recorded_between(
    since: dt.datetime | None, until: dt.datetime | None, *, via: str = ""
) -> Q:
    """The events of invocations recorded in [since, until), said of their partition
    key (reached through the relation `via`, such as "events__") so that the months
    outside it are not read."""
    months = Q()
    if since is not None:
        months &= Q((f"{via}invocation_created_at__gte", since))
    if until is not None:
        months &= Q((f"{via}invocation_created_at__lt", until))
    return months


class EventQuerySet(models.QuerySet["Event"]):
    def of(self, invocation: Invocation) -> EventQuerySet:
        """The invocation's events, read in its own month's partition only: PostgreSQL
        looks in every month's index for an invocation whose month it is not told."""
        return self.filter(invocation=invocation.pk, invocation_created_at=invocation.created_at)

    def recorded_between(
        self, since: dt.datetime | None, until: dt.datetime | None
    ) -> EventQuerySet:
        """The events of invocations recorded in [since, until): the months outside it
        are not read."""
        return self.filter(events_recorded_between(since, until))


class Event(models.Model):
    """An append-only fact, hash-chained per invocation.

    `hash = sha256(prev_hash ‖ canonical(event))`; PostgreSQL itself refuses UPDATE
    and DELETE on this table (see migration 0002). The table is partitioned by the
    month its invocation was recorded in (migration 0033, ledger/partitions.py), so its
    primary key in the database is (id, invocation_created_at); ids stay unique.
    """

    # Indexed through event_seq_unique.
    invocation = models.ForeignKey(
        Invocation, on_delete=models.PROTECT, related_name="events", db_index=False
    )
    seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=48)
    actor = models.CharField(max_length=160)
    data = models.JSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)
    # The partition key: the invocation's created_at, which nothing can change, so an
    # invocation's events share one partition (the evidence SQL copies it, ledger/store.py).
    invocation_created_at = models.DateTimeField(editable=False)

    objects = EventQuerySet.as_manager()

    class Meta:
        constraints = [
            # (invocation, seq): the partition key is functionally the invocation's, and
            # PostgreSQL takes no unique index on a partitioned table without it.
            models.UniqueConstraint(
                fields=["invocation", "seq", "invocation_created_at"], name="event_seq_unique"
            ),
        ]
        # The timeline of one invocation is read through event_seq_unique.
        indexes = [
            # The sealer's look for unsealed events, and audit searches by time.
            models.Index(fields=["created_at"], name="event_created_at"),
            # What people did (the audit search by operator): a small partial index, so
            # runtime events, nearly all of them, skip it. A person's events are in it
            # in their invocations' order, (created_at, id), which the search pages by.
            # Its condition holds for every "user:…" actor and for no "runtime:…" or
            # "ledger:…" one (in C and in the ICU collations en, und, da and tr alike),
            # and `actor = 'user:olga'` implies it: a search needs no second condition,
            # which PostgreSQL would take for an independent one and so expect a
            # thousandth of the person's events.
            models.Index(
                fields=["actor", "invocation_created_at", "invocation"],
                condition=Q(actor__gt="user:"),
                name="event_by_person",
            ),
            # The action log, people's actions newest first, a page at a time, under the
            # log's own condition. Without it PostgreSQL walked each month's events back
            # from the newest, runtime events and all, until it had a page of people's:
            # a month with none, it read whole.
            models.Index(
                fields=["id"], condition=Q(actor__startswith="user:"), name="event_person_newest"
            ),
            # Recent probe runs (the dashboard, /metrics) without reading every recent event.
            models.Index(
                fields=["created_at"], condition=Q(kind="probe_run"), name="event_probe_run_time"
            ),
            # Probe claims reopened in the last hour (/metrics): their worker died, or
            # held its lease past its end.
            models.Index(
                fields=["created_at"],
                condition=Q(kind__in=REOPENED_CLAIM_KINDS),
                name="event_claim_reopened_time",
            ),
            # Links by business reference: the invocations whose evidence (an outcome, a
            # probe's finding, a resolution) names one. Partial: the events that name
            # none skip it. Migration 0024 adds the statistics of its expression, which
            # PostgreSQL keeps for no partial index and Django cannot declare.
            models.Index(
                KeyTransform("business_reference", "data"),
                condition=HAS_BUSINESS_REFERENCE,
                name="event_business_reference",
            ),
            # Recent shared references (/metrics): rare, so the index is tiny.
            models.Index(
                fields=["created_at"],
                condition=NAMES_A_SHARED_REFERENCE,
                name="event_shared_reference_time",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.invocation_id}#{self.seq} {self.kind}"


class Seal(models.Model):
    """A checkpoint over every event sealed since the previous seal.

    `merkle_root` covers the sealed events' hashes in their global sequence order;
    `hash = sha256(prev_hash ‖ canonical(seal))` chains the seals. Append-only.
    """

    first_sequence = models.BigIntegerField()
    last_sequence = models.BigIntegerField()
    event_count = models.PositiveIntegerField()
    merkle_root = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64, unique=True)

    class Meta:
        constraints = [
            # Each sequence number is sealed once; the newest seal is found by this index.
            models.UniqueConstraint(fields=["last_sequence"], name="seal_last_sequence_unique"),
        ]

    def __str__(self) -> str:
        return f"seal {self.pk} ({self.first_sequence}-{self.last_sequence})"


class Anchor(models.Model):
    """A seal's hash and the action log's newest, as sent outside the database
    (ledger.anchors): to a store whose keepers are not the database's, so that a
    history rewritten with its hashes recomputed no longer leads to them. Append-only:
    the ledger's own note of what it sent, where, and what the store answered.
    """

    seal = models.ForeignKey(Seal, on_delete=models.PROTECT, null=True, related_name="+")
    seal_hash = models.CharField(max_length=64, blank=True)
    action = models.ForeignKey("AdminAction", on_delete=models.PROTECT, null=True, related_name="+")
    action_hash = models.CharField(max_length=64, blank=True)
    url = models.CharField(max_length=500)
    sent_at = models.DateTimeField(default=timezone.now)
    status = models.PositiveSmallIntegerField()
    # The store's answer (its receipt: a record's id), cut short; from a time-stamping
    # authority, when and under what serial number it signed.
    receipt = models.TextField(blank=True)
    # A time-stamping authority's whole answer (RFC 3161 TimeStampResp, DER): its
    # signature over this anchor's message, which the ledger and anyone holding the
    # authority's root certificate can check (ledger.anchors.check_token).
    token = models.BinaryField(null=True, editable=False)

    def __str__(self) -> str:
        return f"anchor {self.pk}: seal {self.seal_hash or '-'}, action {self.action_hash or '-'}"


class SealedEventQuerySet(models.QuerySet["SealedEvent"]):
    def with_events(self) -> SealedEventQuerySet:
        """Each one's event as `partitioned_event`, joined on the partition key too, so
        that PostgreSQL reads one month partition for it rather than every one."""
        return self.annotate(
            partitioned_event=FilteredRelation(
                "event",
                condition=Q(event__invocation_created_at=F("event_invocation_created_at")),
            )
        )


class SealedEvent(models.Model):
    """An event's place in the global order, given when it was sealed (append-only).

    Event ids are not commit order, so the sealer numbers events as it finds them
    committed; the sequence is what seals and exports are ordered by.
    """

    sequence = models.BigIntegerField(primary_key=True)
    # No foreign key in the database: one to a partitioned table would have to name its
    # partition key. No event can be deleted from under it (migration 0002).
    event = models.OneToOneField(
        Event, on_delete=models.PROTECT, related_name="sealed", db_constraint=False
    )
    # The event's partition key (migration 0034): read through with_events().
    event_invocation_created_at = models.DateTimeField(editable=False)
    seal = models.ForeignKey(Seal, on_delete=models.PROTECT, related_name="entries")

    objects = SealedEventQuerySet.as_manager()

    def __str__(self) -> str:
        return f"#{self.sequence}: {self.event_id}"  # type: ignore[attr-defined]


class RateWatch(models.Model):
    """How far the rate-limit watch has read the sealed events for one capability that
    declares `execution.rate_limit`, and the admissions it remembers to judge the next
    ones by (`ledger.rate_limits`).

    Not evidence: each breach it finds is recorded as an event of its invocation. A
    watch judges and counts only admissions made since the declaration that set its
    limit was registered (`since`): admissions made while no limit, or another one, was
    declared are never judged by this one.
    """

    scope = models.CharField(max_length=160, primary_key=True)
    # The limit as declared, and since when: the registration of the declaration.
    rate_limit = models.JSONField(default=dict, blank=True)
    since = models.DateTimeField()
    # The last sealed event (SealedEvent.sequence) read.
    through_sequence = models.BigIntegerField()
    # The newest admissions read, at most the declared count, none older than one
    # window before the newest: all a sliding window needs of the past.
    admissions = ArrayField(models.DateTimeField(), default=list, blank=True)
    # Breaches found whose invocation the ledger refused to change (its row was changed
    # outside the ledger): each run tries them again, until an admin restores the row.
    unrecorded = models.JSONField(default=list, blank=True)
    # False once the capability withdrew its limit: the row stays only while breaches
    # found under the limit wait to be recorded.
    watching = models.BooleanField(default=True)

    def __str__(self) -> str:
        return f"rate watch of {self.scope} through #{self.through_sequence}"


class RateAdmission(models.Model):
    """An attempt admitted under a capability whose declared rate limit the ledger
    enforces (`Capability.rate_limit_enforced`), numbered in the order of admission
    under the capability's lock: the admission `count` numbers before the next one
    says whether the next one has room (`ledger.rate_enforcement`).

    Not evidence (the attempt and its `attempt_admitted` event are): only the newest
    `count` of a capability are kept.
    """

    scope = models.CharField(max_length=160)
    number = models.BigIntegerField()
    admitted_at = models.DateTimeField()
    invocation_id = models.CharField(max_length=128)
    attempt_id = models.CharField(max_length=128)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "number"], name="rate_admission_number")
        ]

    def __str__(self) -> str:
        return f"{self.scope} {self.invocation_id}/{self.attempt_id} at {self.admitted_at}"


class ReferenceWatch(models.Model):
    """How far the reference watch has read the sealed events (`ledger.shared_references`):
    one row, made by its first run.

    Not evidence: what it finds is recorded as events of the invocations it flags.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    # The last sealed event (SealedEvent.sequence) read.
    through_sequence = models.BigIntegerField(default=0)
    # What it found on invocations the ledger refused to change (their rows were changed
    # outside the ledger): each run tries them again, until an admin restores the row.
    unrecorded = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(id=1), name="reference_watch_one_row")]

    def __str__(self) -> str:
        return f"reference watch through #{self.through_sequence}"


class VerificationPass(models.Model):
    """One background pass of verify_ledger over the whole ledger, slices of it each
    run of beat's task (`ledger.integrity.verify_slices_for`): every chain, its replay
    through the retry policy and its row, every seal, the action log's chain, and (in
    its first slice) every capability against the action log.

    A pass covers what existed when it started (up to `until_invocation`, `until_seal`
    and `until_admin_action`); what is recorded later is the next pass's. The first BREAKS_KEPT
    breaks are kept, each as verify_ledger prints it (`break`) with the invocation it
    is in (`invocation_id`, null for a seal's).
    """

    BREAKS_KEPT = 100

    started_at = models.DateTimeField(default=timezone.now)
    checked_at = models.DateTimeField(default=timezone.now)  # the last slice's end
    finished_at = models.DateTimeField(null=True, blank=True)
    until_invocation = models.BigIntegerField()
    # How many invocations it covers, counted as it started (null for passes started
    # before migration 0043): how far it has come, and at its pace when it will end.
    invocations_to_check = models.PositiveBigIntegerField(null=True, blank=True)
    until_seal = models.BigIntegerField()
    # Where the next slice starts: after this invocation (pk) and this seal (its
    # first_sequence), whose hash the next seal must name as its prev_hash.
    after_invocation = models.BigIntegerField(default=0)
    after_seal = models.BigIntegerField(default=0)
    after_seal_hash = models.CharField(max_length=64, default=GENESIS_HASH)
    # The action log's chain likewise: up to this row (pk), after this one and its hash.
    until_admin_action = models.BigIntegerField(default=0)
    after_admin_action = models.BigIntegerField(default=0)
    after_admin_action_hash = models.CharField(max_length=64, default=GENESIS_HASH)
    invocations = models.PositiveBigIntegerField(default=0)
    events = models.PositiveBigIntegerField(default=0)
    seals = models.PositiveBigIntegerField(default=0)
    admin_actions = models.PositiveBigIntegerField(default=0)
    capabilities = models.PositiveIntegerField(default=0)
    break_count = models.PositiveIntegerField(default=0)
    breaks = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [
            # One pass runs at a time; the task also takes an advisory lock, so two
            # beats (a misconfiguration) skip rather than fail on this.
            models.UniqueConstraint(
                fields=["finished_at"],
                condition=Q(finished_at__isnull=True),
                nulls_distinct=False,
                name="verification_pass_one_running",
            ),
        ]
        # The newest passes, for /metrics and the dashboard.
        indexes = [models.Index(fields=["-started_at"], name="verification_pass_newest")]

    def __str__(self) -> str:
        return f"verification pass {self.pk} from {self.started_at:%Y-%m-%d %H:%M}"

    def expected_end(self) -> dt.datetime | None:
        """When a running pass should end, at the pace it has kept so far (its slices
        and the waits between them), once it has a pace; None before, or when finished."""
        took = self.checked_at - self.started_at
        if self.finished_at or not self.invocations_to_check or not self.invocations or not took:
            return None
        left = max(self.invocations_to_check - self.invocations, 0)
        return self.checked_at + took * left / self.invocations

    @cached_property
    def first_breaks(self) -> list[dict[str, Any]]:
        """The first ten breaks kept, each a row's with the `projection_restored` event
        that put the row back since the pass started, if one did (`restored`): the pass
        found it, and until the next pass finds none it still counts it."""
        shown = self.breaks[:10]
        rows = [b["invocation_id"] for b in shown if b["break"].startswith("projection")]
        restores = Event.objects.filter(
            kind="projection_restored",
            invocation__invocation_id__in=rows,
            created_at__gte=self.started_at,
        ).order_by("created_at")
        restored = {
            event.invocation.invocation_id: event for event in restores.select_related("invocation")
        }
        return [
            {**broken, "restored": restored.get(broken["invocation_id"])}
            if broken["break"].startswith("projection")
            else broken
            for broken in shown
        ]


def _shown(path: str, value: Any) -> str:
    """A setting's value as the console shows it: whole masked under a secret-looking
    key (`probe.headers.Authorization`), its own secret-looking keys masked."""
    if SECRET_KEY_PATTERN.search(path.rpartition(".")[2]):
        return json.dumps(REDACTED)
    return json.dumps(redact(value))


def _changed(path: str, before: Any, after: Any) -> Iterator[str]:
    """`path: before → after`; where both are settings of several keys (a probe), one
    line for each key that changed, named by its path (`probe.url`), `absent` where
    there is none. A secret that changed shows so, masked both sides."""
    several = isinstance(before, dict) and isinstance(after, dict) and before and after
    if not several or SECRET_KEY_PATTERN.search(path.rpartition(".")[2]):
        yield f"{path}: {_shown(path, before)} → {_shown(path, after)}"
        return
    for key in sorted(before.keys() | after.keys()):
        inner = f"{path}.{key}"
        if key not in after:
            yield f"{inner}: {_shown(inner, before[key])} → absent"
        elif key not in before:
            yield f"{inner}: absent → {_shown(inner, after[key])}"
        elif before[key] != after[key]:
            yield from _changed(inner, before[key], after[key])


class AdminAction(models.Model):
    """What administrators did outside any invocation: tokens issued and revoked,
    capability declarations registered, capability settings changed.

    Append-only, like the evidence (migration 0012), and hash-chained in one chain in
    the order recorded: `hash = sha256(prev_hash ‖ canonical(action))`, so a row
    rewritten or taken out is found by verification (`ledger.integrity`). Written
    only by `record`.
    """

    actor = models.CharField(max_length=160)
    action = models.CharField(max_length=48)
    target = models.CharField(max_length=200)
    reason = models.TextField(blank=True)
    # What the action was, where its three words are not enough: the digest and the
    # derived fields of a declaration, the settings a change left (ledger.capabilities).
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)

    class Meta:
        indexes = [models.Index(fields=["-created_at"], name="admin_action_recent")]
        constraints = [
            # Each row follows one row: the chain cannot fork, whoever writes.
            models.UniqueConstraint(fields=["prev_hash"], name="admin_action_one_successor"),
        ]

    def __str__(self) -> str:
        return f"{self.actor} {self.action} {self.target}"

    @property
    def change(self) -> str:
        """What `details` says, on one line, for the console: of a setting of several
        keys (a probe), the keys that changed; secret-looking values (a probe's
        Authorization header, say) masked, as in stored arguments."""
        if "changed" in self.details:
            return "; ".join(
                line
                for name, change in self.details["changed"].items()
                for line in _changed(name, change["from"], change["to"])
            )
        if "version" in self.details:
            return f"version {self.details['version']}, from {self.details.get('source', '?')}"
        return ""

    def body(self) -> dict[str, Any]:
        """What its hash covers."""
        body: dict[str, Any] = {
            "actor": self.actor,
            "action": self.action,
            "target": self.target,
            "reason": self.reason,
            "created_at": self.created_at.astimezone(dt.UTC).isoformat(),
        }
        # Only when there are any: the rows chained before details existed (migration
        # 0031) keep the hashes they were logged with.
        if self.details:
            body["details"] = self.details
        return body

    @classmethod
    def record(
        cls,
        *,
        actor: str,
        action: str,
        target: str,
        reason: str = "",
        details: dict[str, Any] | None = None,
    ) -> AdminAction:
        """Append an action to the chain; one writer at a time (an advisory lock held
        to the end of the caller's transaction)."""
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(hashtext('ledger.admin_action'))")
            last = cls.objects.order_by("-id").values_list("hash", flat=True).first()
            row = cls(actor=actor, action=action, target=target, reason=reason)
            row.details = details or {}
            row.prev_hash = last or GENESIS_HASH
            row.hash = event_hash(row.prev_hash, row.body())
            row.save()
            # Kept by whatever collects the logs, the newest hash shows whether rows
            # were taken off the chain's end, which no later link can (as the sealer's
            # log does for seals): so only once the row is there to be anchored.
            transaction.on_commit(
                lambda: log.info(
                    "admin action id=%d action=%s hash=%s", row.pk, row.action, row.hash
                )
            )
        return row
