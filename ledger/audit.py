"""Audit search and export: filters over invocations, streamed evidence rows."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from typing import Any

from django import forms
from django.db.models import Exists, OuterRef, QuerySet

from ledger import policy
from ledger.models import Event, Invocation

EXPORT_COLUMNS = [
    "invocation_id", "task_id", "runtime", "capability", "subject", "status", "cause",
    "flags", "seq", "kind", "actor", "created_at", "prev_hash", "hash", "data",
]  # fmt: skip


class AuditFilterForm(forms.Form):
    since = forms.DateTimeField(required=False, help_text="from (UTC)")
    until = forms.DateTimeField(required=False, help_text="before (UTC)")
    runtime = forms.CharField(required=False)
    task_id = forms.CharField(required=False)
    invocation_id = forms.CharField(required=False)
    subject = forms.CharField(required=False)
    capability = forms.CharField(required=False)
    status = forms.ChoiceField(
        required=False, choices=[("", "any status"), *[(s.value, s.value) for s in policy.Status]]
    )
    cause = forms.ChoiceField(
        required=False, choices=[("", "any cause"), *[(c.value, c.value) for c in policy.Cause]]
    )
    flag = forms.ChoiceField(
        required=False, choices=[("", "any flags"), *[(f.value, f.value) for f in policy.Flag]]
    )
    operator = forms.CharField(required=False, help_text="a console user who acted")
    order = forms.ChoiceField(
        required=False, choices=[("newest", "newest first"), ("oldest", "oldest first")]
    )
    after = forms.IntegerField(required=False, widget=forms.HiddenInput, min_value=0)


def search(data: dict[str, Any]) -> QuerySet[Invocation]:
    """The invocations matching the filters, in time order (id order is creation order)."""
    rows = Invocation.objects.select_related("runtime")
    exact = {
        "runtime": "runtime__name",
        "task_id": "task_id",
        "invocation_id": "invocation_id",
        "subject": "subject",
        "capability": "capability_scope",
        "status": "status",
        "cause": "cause",
    }
    for name, lookup in exact.items():
        if data.get(name):
            rows = rows.filter(**{lookup: data[name]})
    if data.get("since"):
        rows = rows.filter(created_at__gte=data["since"])
    if data.get("until"):
        rows = rows.filter(created_at__lt=data["until"])
    if data.get("flag"):
        rows = rows.filter(flags__contains=[data["flag"]])
    if data.get("operator"):
        acted = Event.objects.filter(invocation=OuterRef("pk"), actor=f"user:{data['operator']}")
        rows = rows.filter(Exists(acted))
    newest_first = data.get("order", "newest") != "oldest"
    if data.get("after"):
        rows = (
            rows.filter(pk__lt=data["after"]) if newest_first else rows.filter(pk__gt=data["after"])
        )
    return rows.order_by("-pk" if newest_first else "pk")


def export_rows(invocations: QuerySet[Invocation]) -> Iterator[dict[str, Any]]:
    """Every event of the matching invocations, one row each, in constant memory."""
    events = (
        Event.objects.filter(invocation__in=invocations.order_by().values("pk"))
        .select_related("invocation__runtime")
        .order_by("invocation_id", "seq")
    )
    for event in events.iterator(chunk_size=2000):
        invocation = event.invocation
        yield {
            "invocation_id": invocation.invocation_id,
            "task_id": invocation.task_id,
            "runtime": invocation.runtime.name,
            "capability": invocation.capability_scope,
            "subject": invocation.subject,
            "status": invocation.status,
            "cause": invocation.cause,
            "flags": " ".join(invocation.flags),
            "seq": event.seq,
            "kind": event.kind,
            "actor": event.actor,
            "created_at": event.created_at.isoformat(),
            "prev_hash": event.prev_hash,
            "hash": event.hash,
            "data": json.dumps(event.data, sort_keys=True),
        }


class _Echo:
    def write(self, value: str) -> str:
        return value


def csv_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    writer = csv.DictWriter(_Echo(), fieldnames=EXPORT_COLUMNS)
    yield writer.writeheader()  # type: ignore[func-returns-value]
    for row in rows:
        yield writer.writerow(row)  # type: ignore[misc]


def jsonl_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    for row in rows:
        yield json.dumps({**row, "data": json.loads(row["data"])}) + "\n"
