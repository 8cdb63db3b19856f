"""Canonical JSON (RFC 8785), digests, redaction and the per-invocation hash chain."""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import rfc8785

GENESIS_HASH = "0" * 64
REDACTED = "[redacted]"
# Keys that look like secrets are masked in every stored copy, whatever the policy.
SECRET_KEY_PATTERN = re.compile(
    r"passw(or)?d|passphrase|secret|token|authori[sz]ation|api[-_]?key|private[-_]?key"
    r"|credential|card[-_]?(number|no)|cvv|cvc|iban|^pan$|^pin$",
    re.IGNORECASE,
)
_SORTED_JSON = msgspec.json.Encoder(order="sorted")
# JSON integers past this lose precision in I-JSON (RFC 8785 requires IEEE 754).
MAX_SAFE_INTEGER = 2**53 - 1


class CanonicalizationError(ValueError):
    """The value cannot be represented in canonical JSON; `path` names where."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def to_jsonable(value: Any, path: str = "$", max_depth: int = 64) -> Any:
    """Convert Decimal, datetime and big integers to strings RFC 8785 accepts.

    Floats that are not finite are refused: JSON has no NaN or Infinity.
    """
    return _Prepared(value, path, max_depth).value


class _Unrepresentable(Exception):
    """Raised deep in a value; each level on the way out prepends its step to `path`."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.steps: list[str] = []


class _Prepared:
    """`value` made JSON-ready, and whether msgspec would already write it as RFC 8785.

    msgspec's JSON encoder with sorted keys writes the same bytes as RFC 8785 for
    strings, integers, booleans and null, and sorts keys the same way while they are
    ASCII; it is about ten times faster than the rfc8785 package and json.dumps.
    Floats (ECMAScript number formatting) and non-ASCII keys (UTF-16 ordering) go to
    the rfc8785 package instead. The property test in tests/ledger/test_chain.py
    checks the two agree.

    Every event hash walks its body here, so the walk builds no path strings: the
    path of an offending value is assembled only when one is found.
    """

    def __init__(self, value: Any, path: str, max_depth: int) -> None:
        self.plain = True
        try:
            self.value = self.convert(value, max_depth)
        except _Unrepresentable as exc:
            raise CanonicalizationError(path + "".join(reversed(exc.steps)), exc.message) from None

    def convert(self, value: Any, depth: int) -> Any:
        if depth < 0:
            raise _Unrepresentable("nested too deeply")
        kind = type(value)
        if value is None or kind is str or kind is bool:
            return value
        if kind is dict or isinstance(value, Mapping):
            out = {}
            for key, item in value.items():
                if type(key) is not str:
                    raise _Unrepresentable("object keys must be strings")
                if not key.isascii():
                    self.plain = False
                try:
                    out[key] = self.convert(item, depth - 1)
                except _Unrepresentable as exc:
                    exc.steps.append(f".{key}")
                    raise
            return out
        if kind is list or kind is tuple:
            converted = []
            for i, item in enumerate(value):
                try:
                    converted.append(self.convert(item, depth - 1))
                except _Unrepresentable as exc:
                    exc.steps.append(f"[{i}]")
                    raise
            return converted
        if isinstance(value, int):
            return value if abs(value) <= MAX_SAFE_INTEGER else str(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _Unrepresentable("NaN and Infinity are not JSON numbers")
            self.plain = False
            return value
        if isinstance(value, str):  # a str subclass
            return str(value)
        if isinstance(value, list | tuple):
            return self.convert(list(value), depth)
        if isinstance(value, decimal.Decimal):
            if not value.is_finite():
                raise _Unrepresentable("NaN and Infinity are not JSON numbers")
            return str(value)
        if isinstance(value, dt.datetime | dt.date | dt.time):
            return value.isoformat()
        raise _Unrepresentable(f"{type(value).__name__} is not JSON")


def _already_plain(value: Any, depth: int) -> bool:
    """Whether `value` is JSON that msgspec writes as RFC 8785 exactly as it is.

    Event bodies nearly always are; checking costs half as much as `_Prepared`,
    which copies the value while converting it.
    """
    return _all_plain((value,), depth)


def _all_plain(values: Iterable[Any], depth: int) -> bool:
    """`_already_plain` for each of `values`, containers at most `depth` deep.

    Leaves are checked in the loop, not by a call each: an event body has about
    fifty of them.
    """
    for value in values:
        kind = type(value)
        if kind is str or kind is bool or value is None:
            continue
        if kind is int:
            if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
                continue
            return False
        if depth <= 0:
            return False
        if kind is dict:
            for key in value:
                if type(key) is not str or not key.isascii():
                    return False
            if not _all_plain(value.values(), depth - 1):
                return False
        elif kind is not list or not _all_plain(value, depth - 1):
            return False
    return True


def canonical(value: Any) -> bytes:
    """RFC 8785 (JSON Canonicalization Scheme) bytes of `value`."""
    try:
        if _already_plain(value, 64):
            return _SORTED_JSON.encode(value)
        prepared = _Prepared(value, "$", 64)
        if prepared.plain:
            return _SORTED_JSON.encode(prepared.value)
        return rfc8785.dumps(prepared.value)
    except (UnicodeEncodeError, rfc8785.CanonicalizationError) as exc:
        raise CanonicalizationError("$", f"not representable as canonical JSON: {exc}") from None


def digest(value: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical(value)).hexdigest()


def redact(value: Any, paths: Iterable[str] = (), *, mask_all: bool = False) -> Any:
    """A copy with secret-looking keys, listed dotted paths (or, with mask_all,
    every leaf value) replaced by a marker. Lists are traversed with `[]` elided:
    `items.card` masks `card` in every element of `items`."""
    return _redacted(value, "", frozenset(paths), mask_all)


def _redacted(node: Any, path: str, listed: frozenset[str], mask_all: bool) -> Any:
    # A function of its own, not a closure calling itself: that is a reference cycle,
    # garbage for the collector to find on every write.
    if isinstance(node, Mapping):
        out = {}
        for key, item in node.items():
            child = f"{path}.{key}" if path else str(key)
            if child in listed or SECRET_KEY_PATTERN.search(str(key)) is not None:
                out[key] = REDACTED
            else:
                out[key] = _redacted(item, child, listed, mask_all)
        return out
    if isinstance(node, list):
        return [_redacted(item, path, listed, mask_all) for item in node]
    if mask_all and node is not None:
        return REDACTED
    return node


def event_hash(prev_hash: str, body: Mapping[str, Any]) -> str:
    return hashlib.sha256(prev_hash.encode() + canonical(body)).hexdigest()
