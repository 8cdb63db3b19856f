from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from django.conf import settings
from rest_framework import exceptions, status
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "payload_too_large"


class StrictJSONParser(JSONParser):
    """JSON only, with a byte limit per endpoint; no NaN, Infinity, lone surrogates or
    duplicate keys.

    The view may set `max_body_bytes`; bodies over it are refused with 413 before
    they are parsed. msgspec parses: it is several times faster than json.loads on a
    batch, and it refuses what JSON's grammar allows but Unicode and PostgreSQL do
    not (a lone UTF-16 surrogate such as "\\ud800" made a 500 where a string was
    hashed or stored), as well as numbers past a double's range.
    """

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        request = (parser_context or {}).get("request")
        encoding = request.META.get("HTTP_CONTENT_ENCODING", "identity") if request else ""
        if encoding.strip().lower() not in ("", "identity"):
            # Read as JSON, a compressed body would be refused as malformed, and the
            # runtime left to look for a fault in JSON it wrote correctly.
            raise exceptions.UnsupportedMediaType(
                media_type or self.media_type,
                f"Content-Encoding {encoding!r} is not accepted: send the JSON uncompressed.",
            )
        view = (parser_context or {}).get("view")
        limit = getattr(view, "max_body_bytes", settings.LEDGER_MAX_BODY_BYTES)
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"The request body is over the limit of {limit} bytes.")
        if not raw:
            raise ParseError("The request body is empty; a JSON document is required.")
        try:
            value = msgspec.json.decode(raw)
        except RecursionError:
            raise ParseError("The JSON document is nested too deeply.") from None
        except msgspec.MsgspecError as exc:
            raise ParseError(f"The body is not valid JSON: {_explain(raw, exc)}") from None
        # The count is a cheap filter; a second parse decides, and names the key.
        if _separators(raw) != _keys(value) and (repeated := _duplicate(raw)) is not None:
            raise ParseError(f"The body is not valid JSON: {repeated}")
        return value


# A JSON string, escapes included (written as an unrolled loop, twice as fast as an
# alternation: 5 ms on a 1,000-item batch).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def _separators(raw: bytes) -> int:
    """The name separators of a valid JSON document: its colons outside strings."""
    return _STRING.sub(b"", raw).count(b":")


def _keys(value: Any) -> int:
    """The keys of every object in a decoded document.

    Fewer than the document's name separators means an object named a key twice and
    the parser kept only the last value. Such a document is refused rather than
    recorded as one of its readings: RFC 8785 (I-JSON) forbids it, and another
    parser, the runtime's, may have kept the first.
    """
    count, pending = 0, [value]
    while pending:
        item = pending.pop()
        if type(item) is dict:
            count += len(item)
            pending.extend(item.values())
        elif type(item) is list:
            pending.extend(item)
    return count


def _duplicate(raw: bytes) -> str | None:
    """Which key was repeated, found by a second, slower parse that sees every pair;
    None if none was."""

    def refuse_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, item in pairs:
            if key in seen:
                raise ValueError(f"the key {key!r} appears twice in one object")
            seen[key] = item
        return seen

    try:
        json.loads(raw, object_pairs_hook=refuse_repeats)
    except ValueError as exc:
        return str(exc)
    return None


def _explain(raw: bytes, error: msgspec.MsgspecError) -> str:
    """A clearer reason than msgspec's where json.loads can give one."""
    try:
        json.loads(raw)
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError
        return str(exc)
    except RecursionError:
        return str(error)
    if "truncated" in str(error) or "surrogate" in str(error):
        return "a string holds a lone UTF-16 surrogate (\\ud800 to \\udfff without its pair)"
    return str(error)
