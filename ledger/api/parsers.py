from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from ledger.api.errors import PayloadTooLarge


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


class StrictJSONParser(JSONParser):
    """JSON only, with a byte limit per endpoint and no NaN/Infinity.

    The view may set `max_body_bytes`; bodies over it are refused with 413 before
    they are parsed.
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
            return json.loads(raw, parse_constant=_refuse_constant)
        except RecursionError:
            raise ParseError("The JSON document is nested too deeply.") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ParseError(f"The body is not valid JSON: {exc}") from None
