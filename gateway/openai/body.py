"""The request class of the completion routes: the body is checked and decoded here, before
Litestar hands it to the handler as `data` (so the OpenAPI document shows its type).

Checks, in order: a JSON Content-Type (415), a body at all, nesting no deeper than
`MAX_NESTING`, then msgspec's strict decode into the handler's `data` type (400s naming the
field). The caller's key was checked by the router's guard before any of it is read.
"""

from __future__ import annotations

from typing import Any

from litestar import Request

from gateway.errors import BadRequest
from gateway.openai.schemas import decode, require_json


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
