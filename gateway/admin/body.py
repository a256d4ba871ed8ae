"""The request class of the admin router: its JSON body is decoded strictly, straight into the
type the handler declares for `data`.

Litestar would decode the JSON and then convert it leniently (`"60"` would pass as 60); here the
one decode is msgspec's strict one into the struct, which Litestar then hands over unchanged.
Unknown fields, wrong types, numbers out of range, invalid UTF-8 and nesting beyond msgspec's
limit are refused (`gateway.errors` maps them to a 400 naming the field). An empty body is `{}`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request


class AdminRequest(Request[Any, Any, Any]):
    async def json(self) -> Any:
        field = self.route_handler.parsed_data_field
        raw = (await self.body()).strip() or b"{}"
        return msgspec.json.decode(raw, type=field.annotation if field is not None else Any)
