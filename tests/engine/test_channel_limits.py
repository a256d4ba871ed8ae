"""What a peer without the engine token can make a CURVE engine hold before its handshake is
refused: ZeroMQ reads the handshake's frames through the same decoder as messages, so the
socket's frame limit (ZMQ_MAXMSGSIZE) bounds what one connection may make the engine buffer,
and its handshake deadline (ZMQ_HANDSHAKE_IVL) how long a connection that never completes one
is kept (engine.service.server); the engine process takes as many descriptors as it may
(engine.service.runner), so a stranger's idle connections do not lock its gateways out."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.server import HANDSHAKE_MS
from loramux.engine.service.wire import Reply
from loramux.gateway.engine_client.remote import RemoteEngineClient
from tests.engine import service_peer
from tests.engine.service_peer import TOKEN, Gateway
from tests.gateway.serve_process import free_port, wait_for

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


SOFT_FDS = 1024
"""A service's usual soft limit on open files (systemd's default LimitNOFILE soft value)."""


@contextlib.contextmanager
def engine_process(
    model_dir: Path, data_dir: Path, soft_fds: int
) -> Iterator[subprocess.Popen[bytes]]:
    """`loramux engine` on a loopback tcp:// port with a token, started with a soft limit of
    `soft_fds` open files (the hard limit left as it is), once /health answers; its channel's
    port is `proc.port`."""
    port, health = free_port(), free_port()
    command = [sys.executable, "-m", "loramux.gateway.cli", "engine", "--health-port", str(health)]
    command += ["--address", f"tcp://127.0.0.1:{port}"]
    env = os.environ | {
        "LORAMUX_MODEL": str(model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_DATA_DIR": str(data_dir),
        "LORAMUX_ENGINE_TOKEN": TOKEN,
    }
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def lower_the_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft_fds, hard))

    log = data_dir / "engine.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lower_the_soft_limit,
        )

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"http://127.0.0.1:{health}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 240, "the engine answers /health")
        proc.port = port  # type: ignore[attr-defined]
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


async def model_name(url: str) -> str:
    client = RemoteEngineClient([url], TOKEN)
    try:
        return (await client.info()).model_name
    finally:
        await client.close()


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connect_paced(pid: int, port: int, count: int) -> list[socket.socket]:
    """`count` plain TCP connections to the engine `pid` on `port`, 50 at a time, each 50 once
    the engine has taken the ones before (or is full): its accept queue (ZMQ_BACKLOG, 100)
    never overflows, so no connection waits a second for its SYN to be sent again, and they
    all reach the engine well within its handshake deadline, as a stranger's would."""
    base, strangers = open_files(pid), []
    while len(strangers) < count:
        for _ in range(min(50, count - len(strangers))):
            strangers.append(socket.create_connection(("127.0.0.1", port)))
        taken = min(base + len(strangers), SOFT_FDS) - 8
        wait_for(lambda: open_files(pid) >= taken, 4, f"the engine takes {taken} descriptors")  # noqa: B023
    return strangers


async def test_idle_connections_of_a_keyless_peer_do_not_lock_gateways_out(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """1,074 plain TCP connections that never send a byte took every descriptor of an engine
    started with the usual soft limit of 1,024 open files: a gateway holding the token found
    the engine unreachable (for as long as the stranger kept opening them; each lasts until
    the handshake deadline). The engine now raises its soft limit to the hard one at start
    (the port should still be firewalled to the gateways' hosts: docs/architecture.md)."""
    count = SOFT_FDS + 50
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * count + 256:
        pytest.skip(f"the hard limit on open files ({hard}) leaves no room above {SOFT_FDS}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, count + 256), hard))
    try:
        with engine_process(demo_model_dir, tmp_path, SOFT_FDS) as engine:
            url = f"tcp://127.0.0.1:{engine.port}"  # type: ignore[attr-defined]
            assert await model_name(url) == "demo-model"
            strangers = connect_paced(engine.pid, engine.port, count)  # type: ignore[attr-defined]
            try:
                assert await model_name(url) == "demo-model"
            finally:
                for stranger in strangers:
                    stranger.close()
            limits = Path(f"/proc/{engine.pid}/limits").read_text()
            assert f"Max open files            {hard}" in limits
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
