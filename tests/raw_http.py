"""HTTP/1.1 over a bare socket, for requests no HTTP library sends: heads of an exact length,
heads sent in pieces, requests pipelined on one connection."""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass
from types import TracebackType
from typing import Any


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def head(target: str, size: int, *, authorization: bool = False) -> bytes:
    """A GET head of exactly `size` bytes, request line and blank line included, padded with a
    header (`Authorization: Bearer aaa…` when `authorization`, else `X-Pad`)."""
    start = f"GET {target} HTTP/1.1\r\nHost: x\r\n".encode()
    name = b"Authorization: Bearer " if authorization else b"X-Pad: "
    pad = size - len(start) - len(name) - 4
    assert pad >= 1, f"a head of {size} bytes cannot hold {target!r}"
    return start + name + b"a" * pad + b"\r\n\r\n"


class Connection:
    """A connection to `url`'s host and port (http://host:port), Nagle off."""

    def __init__(self, url: str) -> None:
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        self.socket = socket.create_connection((host, int(port)), timeout=60)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._read = b""

    def send(self, data: bytes) -> None:
        self.socket.sendall(data)

    def answer(self) -> Answer:
        """The next response (its body by Content-Length)."""
        while b"\r\n\r\n" not in self._read:
            self._receive()
        top, _, self._read = self._read.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)", top)
        assert length is not None, top
        while len(self._read) < int(length[1]):
            self._receive()
        body, self._read = self._read[: int(length[1])], self._read[int(length[1]) :]
        return Answer(int(top.split(b" ", 2)[1]), body)

    def closed(self) -> bool:
        """Whether the server has closed the connection (nothing more comes)."""
        try:
            return not self._read and self.socket.recv(1) == b""
        except ConnectionResetError:
            return True

    def _receive(self) -> None:
        chunk = self.socket.recv(1 << 16)
        assert chunk, "the server closed the connection before it answered"
        self._read += chunk

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.socket.close()
