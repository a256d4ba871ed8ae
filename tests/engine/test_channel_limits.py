"""What a peer without the engine token can make a CURVE engine hold before its handshake is
refused: ZeroMQ reads the handshake's frames through the same decoder as messages, so the
socket's frame limit (ZMQ_MAXMSGSIZE) bounds what one connection may make the engine buffer,
and its handshake deadline (ZMQ_HANDSHAKE_IVL) how long a connection that never completes one
is kept (engine.service.server)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Iterator

from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.server import HANDSHAKE_MS
from loramux.engine.service.wire import Reply
from tests.engine import service_peer
from tests.engine.service_peer import Gateway

service, gateway = service_peer.service, service_peer.gateway

MiB = 1 << 20
MARGIN_SECONDS = 4.0
"""How much later than the engine's handshake deadline a busy test machine may see it."""


def rss_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def curve_greeting() -> bytes:
    """ZMTP 3.0's greeting of a CURVE client: anyone can send it, no key needed."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\x00")
    return greeting + b"\x00" + b"\x00" * 31


def long_command(size: int) -> bytes:
    """The head of a ZMTP command frame (flags: command, long) that says it holds `size` bytes."""
    return bytes([0x06]) + struct.pack(">Q", size)


@contextlib.contextmanager
def stranger_at(service: RunningEngineService, greet: bool = True) -> Iterator[socket.socket]:
    """A plain TCP connection to the engine's port, past the greeting when `greet`."""
    port = int(service.url.rsplit(":", 1)[1])
    stranger = socket.create_connection(("127.0.0.1", port))
    try:
        if greet:
            stranger.sendall(curve_greeting())
            stranger.recv(64)  # the engine's greeting
        yield stranger
    finally:
        stranger.close()


def send_until_cut(stranger: socket.socket, size: int) -> None:
    """Send `size` zero bytes, or as many as the engine takes before it cuts the connection."""
    chunk = b"\x00" * MiB
    with contextlib.suppress(ConnectionError):
        for _ in range(size // MiB):
            stranger.sendall(chunk)


def closed_by_the_engine(stranger: socket.socket, within_s: float) -> bool:
    """Whether the engine closes the connection within `within_s` seconds (whatever it has not
    read of what the stranger sent is discarded)."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        stranger.settimeout(left)
        try:
            if not stranger.recv(MiB):
                return True
        except ConnectionError:
            return True
        except TimeoutError:
            return False
    return False


def test_a_keyless_peer_cannot_make_the_engine_buffer_a_large_handshake_frame(
    service: RunningEngineService, gateway: Gateway
) -> None:
    """Two keyless connections each declared a 500 MiB handshake frame and sent 96 MiB of it:
    the engine held all 192 MiB until ZeroMQ's handshake timeout (30 s), and the peer could
    send it again. Now a frame over the socket's limit (16 MiB) cuts the connection at its
    head."""
    assert isinstance(gateway.call("info"), Reply)
    before = rss_mib()
    with stranger_at(service) as first, stranger_at(service) as second:
        for stranger in (first, second):
            stranger.sendall(long_command(500 * MiB))
            send_until_cut(stranger, 96 * MiB)
        grown = rss_mib() - before
        assert grown < 48, f"the engine buffered {grown} MiB for two peers holding no key"
        assert closed_by_the_engine(first, 2.0) and closed_by_the_engine(second, 2.0)
    assert isinstance(gateway.call("info"), Reply)


def test_a_connection_that_never_completes_its_handshake_is_closed_within_seconds(
    service: RunningEngineService, gateway: Gateway
) -> None:
    """A connection that sends nothing, and one stalled mid-way through a handshake frame within
    the limit, are closed at the engine's handshake deadline: each held a descriptor (and what
    it sent) for ZeroMQ's default 30 s, so a stranger's idle connections could take every
    descriptor the engine has."""
    deadline = HANDSHAKE_MS / 1000 + MARGIN_SECONDS
    with stranger_at(service, greet=False) as silent, stranger_at(service) as stalled:
        stalled.sendall(long_command(8 * MiB))
        send_until_cut(stalled, 4 * MiB)
        assert closed_by_the_engine(silent, deadline), "a silent connection was kept"
        assert closed_by_the_engine(stalled, deadline), "a stalled handshake was kept"
    assert isinstance(gateway.call("info"), Reply)
