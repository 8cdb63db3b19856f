from __future__ import annotations

import datetime as dt

import pytest

from ledger import store
from ledger.models import Invocation

NOW = dt.datetime(2026, 12, 3, 10, 0, tzinfo=dt.UTC)
VALUES = {
    "invocation_id": "inv-1",
    "runtime_id": 7,
    "task_id": "task-1",
    "capability_id": None,
    "capability_scope": "refund.create",
    "idempotency_key": "key-1",
    "arguments": {"order": "SO-1"},
    "arguments_digest": "sha256:" + "0" * 64,
    "created_at": NOW,
    "status": "recorded",
    "flags": ["undeclared"],
    "updated_at": NOW,
}


def fields(row: Invocation) -> dict[str, object]:
    return {f.attname: getattr(row, f.attname) for f in Invocation._meta.concrete_fields}


def test_it_builds_the_same_row_as_the_keyword_constructor() -> None:
    assert fields(store.new_instance(Invocation, **VALUES)) == fields(Invocation(**VALUES))


def test_fields_not_given_take_their_defaults_fresh_each_time() -> None:
    first = store.new_instance(Invocation, invocation_id="a")
    second = store.new_instance(Invocation, invocation_id="b")
    assert first.pk is None
    assert first.assignee == "" and first.probe_tries == 0
    assert first.flags == [] and first.flags is not second.flags


def test_a_field_that_does_not_exist_is_refused() -> None:
    with pytest.raises(TypeError, match=r"\['runtime', 'statuss'\]"):
        store.new_instance(Invocation, statuss="recorded", runtime=None)
