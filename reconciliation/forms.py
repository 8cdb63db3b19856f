from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from django import forms
from django.core.validators import RegexValidator

from ledger import policy
from ledger.api.inputs import PRINTABLE_REGEX
from ledger.models import MAX_RISK_RANK, Capability

TEN_YEARS_IN_MINUTES = 10 * 366 * 24 * 60
MAX_BIGINT = 2**63 - 1
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class QueuePosition:
    """Where a queue page ended, in the queue's own order; written as
    "rank-microseconds-id" so that it stays URL-safe."""

    risk_rank: int
    flagged_at: dt.datetime
    pk: int

    @classmethod
    def parse(cls, value: str) -> QueuePosition:
        parts = value.split("-")
        if len(parts) != 3 or not all(part.isdigit() for part in parts):
            raise ValueError(value)
        rank, micros, pk = (int(part) for part in parts)
        if rank > MAX_RISK_RANK or pk > MAX_BIGINT:
            raise ValueError(value)
        try:
            return cls(rank, EPOCH + dt.timedelta(microseconds=micros), pk)
        except OverflowError:
            raise ValueError(value) from None

    def __str__(self) -> str:
        micros = (self.flagged_at - EPOCH) // dt.timedelta(microseconds=1)
        return f"{self.risk_rank}-{micros}-{self.pk}"


class QueueFilterForm(forms.Form):
    capability = forms.CharField(required=False)
    runtime = forms.CharField(required=False)
    risk = forms.ChoiceField(required=False, choices=[("", "any risk"), *Capability.Risk.choices])
    cause = forms.ChoiceField(
        required=False, choices=[("", "any cause"), *[(c.value, c.value) for c in policy.Cause]]
    )
    # Bounded: a timedelta of 10**20 minutes overflows (a 500 found by fuzzing the queue).
    older_than_minutes = forms.IntegerField(
        required=False, min_value=0, max_value=TEN_YEARS_IN_MINUTES, label="Older than (min)"
    )
    mine = forms.ChoiceField(
        required=False,
        label="On it",
        choices=[("", "everyone's"), ("mine", "claimed by me"), ("unclaimed", "unclaimed")],
    )
    # Set by the queue's "next page" link, never by the filter form itself: changing
    # a filter starts again from the riskiest, oldest invocation.
    after = forms.CharField(required=False, widget=forms.HiddenInput)

    def clean_after(self) -> QueuePosition | None:
        value = self.cleaned_data["after"]
        if not value:
            return None
        try:
            return QueuePosition.parse(value)
        except ValueError:
            raise forms.ValidationError("not a page cursor from this queue") from None


class ActionForm(forms.Form):
    """Every action carries the event count the page showed (stale-page guard)."""

    seen_event_count = forms.IntegerField(widget=forms.HiddenInput, min_value=0)


class ConfirmsSharedReference(forms.Form):
    """An action that counts an effect under a business reference. If other
    invocations' evidence names that reference, the action is refused once and taken
    when the person ticks the box: one effect is never counted for two intents unasked."""

    # Shown only after such a refusal.
    same_reference_confirmed = forms.BooleanField(required=False)
    # Where the refusal is shown: a field's name, or None above the form.
    refusal_field: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared_with: list[str] = []

    def refuse_shared(self, reference: str, others: list[str]) -> None:
        self.shared_with = others
        self.add_error(
            self.refusal_field,
            f"{reference} is already named by {', '.join(others)}. If this invocation's "
            "effect really has that reference, confirm it below.",
        )


class ResolveForm(ActionForm, ConfirmsSharedReference):
    effect = forms.ChoiceField(
        choices=[
            (policy.Effect.PRESENT.value, "the effect happened"),
            (policy.Effect.ABSENT.value, "the effect did not happen"),
        ],
        widget=forms.RadioSelect,
    )
    business_reference = forms.CharField(required=False, max_length=256)
    note = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), max_length=4000)
    refusal_field = "business_reference"

    def clean(self) -> dict[str, object]:
        data = super().clean() or {}
        if data.get("effect") == policy.Effect.PRESENT and not data.get("business_reference"):
            self.add_error("business_reference", "Name the business reference of the effect.")
        return data


class DecisionForm(ActionForm, ConfirmsSharedReference):
    note = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))


class RestoreForm(forms.Form):
    """An admin's putting a row back from its events. No stale-page guard: the row's
    event count is among what may have been edited, and restoring puts back whatever
    differs when it runs, each field recorded in its event with what was found."""

    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), max_length=4000)


class ProbeTryForm(forms.Form):
    """A key to ask a capability's http probe about, recording nothing: an administrator
    checks a probe against a refund they know of (and one they know is missing)."""

    idempotency_key = forms.CharField(
        max_length=256,
        validators=[RegexValidator(PRINTABLE_REGEX, "No control characters.")],
        help_text="The key a runtime sent with an intent of this capability.",
    )
