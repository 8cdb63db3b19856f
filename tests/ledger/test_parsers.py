"""The runtime API's JSON parser refuses duplicate keys, and nothing else that is JSON."""

from __future__ import annotations

import io
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.exceptions import ParseError

from ledger.api.parsers import StrictJSONParser
from tests.ledger.test_chain import json_values


def parse(raw: bytes) -> Any:
    return StrictJSONParser().parse(io.BytesIO(raw), "application/json", {})


@given(json_values)
def test_no_document_without_duplicate_keys_is_refused(value: object) -> None:
    # Escaped or not, with colons, quotes and backslashes anywhere in the strings.
    for raw in (
        json.dumps(value).encode(),
        json.dumps(value, ensure_ascii=False).encode(),
        msgspec.json.encode(value),
    ):
        assert parse(raw) == value


@given(st.dictionaries(st.text(), json_values, min_size=1, max_size=4), st.data())
def test_a_key_named_twice_in_any_object_is_refused(
    members: dict[str, object], data: st.DataObject
) -> None:
    key = data.draw(st.sampled_from(sorted(members)))
    twice = json.dumps(members)[:-1] + f", {json.dumps(key)}: 0}}"
    for raw in (twice, f'{{"outer": [1, {twice}]}}'):
        with pytest.raises(ParseError, match="appears twice in one object"):
            parse(raw.encode())
