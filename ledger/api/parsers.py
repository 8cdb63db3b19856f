from __future__ import annotations

import json
from typing import Any

import msgspec
from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from ledger.api.errors import PayloadTooLarge


class StrictJSONParser(JSONParser):
    """JSON only, with a byte limit per endpoint; no NaN, Infinity or lone surrogates.

    The view may set `max_body_bytes`; bodies over it are refused with 413 before
    they are parsed. msgspec parses: it is several times faster than json.loads on a
    batch, and it refuses what JSON's grammar allows but Unicode and PostgreSQL do
    not (a lone UTF-16 surrogate such as "\\ud800" made a 500 where a string was
    hashed or stored), as well as numbers past a double's range.
    """

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        view = (parser_context or {}).get("view")
        limit = getattr(view, "max_body_bytes", settings.LEDGER_MAX_BODY_BYTES)
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"The request body is over the limit of {limit} bytes.")
        if not raw:
            raise ParseError("The request body is empty; a JSON document is required.")
        try:
            return msgspec.json.decode(raw)
        except RecursionError:
            raise ParseError("The JSON document is nested too deeply.") from None
        except msgspec.MsgspecError as exc:
            raise ParseError(f"The body is not valid JSON: {_explain(raw, exc)}") from None


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
