"""uvicorn's httptools protocol with a bound on request heads (engine.http_heads), serving a
small app on loopback with a bound of 1 KiB: a head of the bound is served, one byte more is
431 and the connection closed, however the head arrives; bodies do not count, and each request
of a connection has the whole bound."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from loramux.engine.http_heads import head_limited_http
from tests.raw_http import Connection, head

BOUND = 1024


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers 200 with the length of the body it read."""
    length, more = 0, True
    while more:
        message = await receive()
        length, more = length + len(message.get("body", b"")), message.get("more_body", False)
    body = str(length).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = uvicorn.Config(
        _echo,
        host="127.0.0.1",
        port=0,
        lifespan="off",
        log_level="error",
        http=head_limited_http(1),
    )
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server failed to start"
        threading.Event().wait(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)


def test_a_head_of_the_bound_is_served_and_one_byte_more_is_refused(url: str) -> None:
    with Connection(url) as http:
        http.send(head("/", BOUND))
        assert http.answer().status == 200
    with Connection(url) as http:
        http.send(head("/", BOUND + 1))
        refused = http.answer()
        assert refused.status == 431
        assert refused.json()["error"]["code"] == "headers_too_large"
        assert http.closed()


@pytest.mark.parametrize("piece", [1, 100, 1000])
def test_a_head_sent_in_pieces_is_counted_all_the_same(url: str, piece: int) -> None:
    too_long = head("/", 3 * BOUND)[: BOUND + 1]
    with Connection(url) as http:
        for at in range(0, len(too_long), piece):
            http.send(too_long[at : at + piece])
        assert http.answer().status == 431
        assert http.closed()


def test_a_long_url_counts_in_the_head(url: str) -> None:
    with Connection(url) as http:
        http.send(b"GET /?q=" + b"a" * BOUND + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert http.answer().status == 431


def test_each_request_of_a_kept_alive_connection_has_the_whole_bound(url: str) -> None:
    with Connection(url) as http:
        for _ in range(4):
            http.send(head("/", BOUND))
            assert http.answer().status == 200


def test_a_body_does_not_count_in_the_head(url: str) -> None:
    body = b"x" * (8 * BOUND)
    post = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    with Connection(url) as http:
        for _ in range(2):
            http.send(post + body)
            served = http.answer()
            assert (served.status, served.body) == (200, str(len(body)).encode())
        http.send(head("/", BOUND))
        assert http.answer().status == 200


def test_pipelined_requests_are_each_given_the_whole_bound(url: str) -> None:
    """Two heads of 600 bytes in one send: their 1,200 bytes are not one head's."""
    with Connection(url) as http:
        http.send(head("/", 600) + head("/", 600))
        assert [http.answer().status for _ in range(2)] == [200, 200]
