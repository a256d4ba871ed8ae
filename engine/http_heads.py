"""uvicorn's httptools protocol with a bound on each request's head: its request line and
headers. The gateway and the engine's health endpoint both serve HTTP with it.

httptools gathers a header's value whole before it hands it to uvicorn, and neither bounds it:
a stranger's 32 MiB `Authorization` was held (and copied again at every read) before any route
could refuse it, and a few such connections made a gateway hold gigabytes. A head longer than
`max_head_bytes` is now answered 431 Request Header Fields Too Large, and its connection closed.

How the bytes are counted. A head is open from the start of a connection, or the end of the
request before it, until its headers are complete. While one is open, a read goes to the parser
in pieces no longer than the room the head has left, and a piece after which the same head is
still open was head bytes all of it: the parser never holds more than `max_head_bytes` of a
head. Each request of a kept-alive connection has the whole bound. A head that begins in the
read that ends the request before it (a client that pipelines) is counted from the next read
on: at most that read's tail (asyncio reads 256 KiB at most) goes uncounted.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

MAX_HEAD_KB = 64
"""The default bound of a request's head (LORAMUX_MAX_HEADER_KB): an API key is ~60 bytes, an
admin JWT a few hundred, a browser's cookies a few KiB."""

HEADERS_TOO_LARGE = 431


class HeadLimitedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a head over `max_head_bytes` (431, then close)."""

    max_head_bytes: ClassVar[int] = MAX_HEAD_KB << 10

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0
        """Bytes of the open head read so far; None while a body is read."""
        self._heads_read = 0
        """Heads complete on this connection: a piece that completes one is not all head."""

    def data_received(self, data: bytes) -> None:
        while data and self._head_bytes is not None:
            room = self.max_head_bytes - self._head_bytes
            if room <= 0:
                self._refuse_head()
                return
            piece, data = data[:room], data[room:]
            heads_read = self._heads_read
            super().data_received(piece)
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # refused (400), or handed to a WebSocket's protocol
            if self._heads_read == heads_read and self._head_bytes is not None:
                self._head_bytes += len(piece)
        if data:
            super().data_received(data)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._heads_read += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_bytes = 0  # the next request's head opens
        super().on_message_complete()

    def _refuse_head(self) -> None:
        limit = f"{self.max_head_bytes >> 10} KiB"
        self.logger.warning("Request head over %s refused (431).", limit)
        message = f"the request line and headers are over {limit} (LORAMUX_MAX_HEADER_KB)"
        error = {"message": message, "type": "invalid_request_error", "param": None}
        body = json.dumps({"error": error | {"code": "headers_too_large"}}).encode()
        head = [STATUS_LINE[HEADERS_TOO_LARGE]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(body)
        )
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def head_limited_http(max_head_kb: int = MAX_HEAD_KB) -> type[HeadLimitedHttp]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`), its heads bounded to
    `max_head_kb` KiB."""
    limit = max_head_kb << 10

    class Bounded(HeadLimitedHttp):
        max_head_bytes = limit

    return Bounded
