"""The request class of the completion routes: the body is checked and decoded here, before
Litestar hands it to the handler as `data` (so the OpenAPI document shows its type).

Checks, in order: a JSON Content-Type (415), a body at all, nesting no deeper than
`MAX_NESTING`, then msgspec's strict decode into the handler's `data` type (400s naming the
field). The caller's key was checked by the router's guard before any of it is read.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np
from litestar import Request

from loramux.gateway.errors import BadRequest, UnsupportedMediaType

MAX_NESTING = 32
"""Deepest nesting of arrays and objects a body may have (a chat body needs 5, a JSON schema in
`response_format` or a tool's parameters a few more per level of the schema)."""


class CompletionRequestBody(Request[Any, Any, Any]):
    async def body(self) -> bytes:
        """The body, refused unless it is declared JSON and not empty (Litestar reads the body
        first and skips `json()` for an empty one, so both are checked here)."""
        require_json(self.headers.get("content-type"))
        body = await super().body()
        if not body:
            raise BadRequest("the request body is empty; send a JSON object")
        return body

    async def json(self) -> Any:
        field = self.route_handler.parsed_data_field
        assert field is not None, "the completion handlers take `data`"
        return decode(await self.body(), field.annotation)


def require_json(content_type: str | None) -> None:
    """415 unless the body is declared as UTF-8 JSON; a body with no Content-Type is read as
    JSON (what a bare `curl --data-binary` or an HTTP library's raw body sends)."""
    if content_type is None:
        return
    media, *params = (part.strip().lower() for part in content_type.split(";"))
    charsets = {p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")}
    if media != "application/json" or not charsets <= {"utf-8", "utf8"}:
        raise UnsupportedMediaType(
            f"the body must be JSON (Content-Type: application/json), not {content_type!r}"
        )


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Parse a JSON body into `kind`; malformed JSON and wrong types are 400s naming the field."""
    if not body:
        raise BadRequest("the request body is empty; send a JSON object")
    if nests_deeper_than(body, MAX_NESTING):
        raise BadRequest(f"the request body nests arrays and objects deeper than {MAX_NESTING}")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in message else None
        raise BadRequest(f"invalid request: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8: {exc}") from None


_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or one never closed: the rest of the text, as a parser reads it. Matched only
where a string starts (scanning from the start), so the scan is linear; when a string that is
never closed did not match, each escaped quote after it was tried as a string's start, and one
tenant's body of escaped quotes held the event loop for seconds (48 KB: 7 s; 1 MiB: half an
hour)."""
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
"""Openers to +1 and closers to -1 (as signed bytes)."""
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nests_deeper_than(body: bytes, limit: int) -> bool:
    """Whether arrays and objects in a JSON text nest deeper than `limit` (brackets inside
    strings do not count, nor those after a string never closed; unclosed openers count, as a
    parser descends into each before it finds the text malformed). The deepest level is the
    largest prefix sum of +1 per opener and -1 per closer, computed at C speed: a 1 MiB body of
    brackets takes milliseconds."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the common case, without reading strings
    steps = _JSON_STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)
    return int(np.cumsum(np.frombuffer(steps, dtype=np.int8), dtype=np.int64).max()) > limit
