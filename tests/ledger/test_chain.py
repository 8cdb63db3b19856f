"""Canonical JSON and digests: RFC 8785 byte for byte, whichever path writes them."""

from __future__ import annotations

import datetime as dt
import decimal
import json

import pytest
import rfc8785
from hypothesis import given
from hypothesis import strategies as st

from ledger import chain

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-chain.MAX_SAFE_INTEGER, max_value=chain.MAX_SAFE_INTEGER)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)


def json_trees(leaves: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
        ),
        max_leaves=25,
    )


json_values = json_trees(json_leaves)


@given(json_values)
def test_it_writes_exactly_what_rfc8785_writes(value: object) -> None:
    try:
        expected = rfc8785.dumps(value)  # type: ignore[arg-type]
    except rfc8785.CanonicalizationError:
        with pytest.raises(chain.CanonicalizationError):
            chain.canonical(value)
        return
    assert chain.canonical(value) == expected


safe_leaves = json_leaves.filter(
    lambda v: not isinstance(v, float) or abs(v) < chain.MAX_SAFE_INTEGER
)
safe_values = json_trees(safe_leaves)


@given(safe_values)
def test_parsing_the_canonical_form_gives_back_the_value(value: object) -> None:
    """(Integral floats past 2^53 parse back as big integers, which become strings.)"""
    try:
        canonical = chain.canonical(value)
    except chain.CanonicalizationError:
        return
    assert chain.canonical(json.loads(canonical)) == canonical


def test_it_sorts_non_ascii_keys_by_utf16_code_units() -> None:
    # U+FFFD sorts after U+1F600 by code point but before it in UTF-16.
    value = {"\U0001f600": 1, "\ufffd": 2}
    assert chain.canonical(value) == rfc8785.dumps(value)
    assert chain.canonical(value).startswith('{"\U0001f600"'.encode())


def test_it_converts_python_values_before_canonicalizing() -> None:
    value = {
        "amount": decimal.Decimal("12.50"),
        "at": dt.datetime(2026, 3, 1, tzinfo=dt.UTC),
        "big": 2**64,
    }
    assert chain.canonical(value) == (
        b'{"amount":"12.50","at":"2026-03-01T00:00:00+00:00","big":"18446744073709551616"}'
    )


def test_integers_stay_numbers_up_to_2_to_the_53_and_become_strings_past_it() -> None:
    edge = chain.MAX_SAFE_INTEGER
    assert chain.canonical([edge, -edge]) == f"[{edge},{-edge}]".encode()
    assert chain.canonical([edge + 1, -edge - 1]) == f'["{edge + 1}","{-edge - 1}"]'.encode()


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), decimal.Decimal("NaN"), {1: "x"}, object(), "\ud800"]
)
def test_it_refuses_what_json_cannot_say(bad: object) -> None:
    with pytest.raises(chain.CanonicalizationError):
        chain.canonical({"v": bad})


def test_the_digest_ignores_key_order_and_whitespace() -> None:
    assert chain.digest({"b": 1, "a": [1, 2]}) == chain.digest(json.loads('{ "a":[1,2], "b":1 }'))
    assert chain.digest({"a": 1}).startswith("sha256:")


def test_redaction_masks_secret_keys_listed_paths_and_everything_when_asked() -> None:
    value = {"password": "p", "customer": {"name": "Ada", "ssn": "1"}, "items": [{"pan": "4"}]}
    assert chain.redact(value, ["customer.ssn"]) == {
        "password": "[redacted]",
        "customer": {"name": "Ada", "ssn": "[redacted]"},
        "items": [{"pan": "[redacted]"}],
    }
    assert chain.redact({"a": {"b": 1}, "c": [True, None]}, mask_all=True) == {
        "a": {"b": "[redacted]"},
        "c": ["[redacted]", None],
    }
