"""A private redis-server for `loramux serve` when no LORAMUX_REDIS_URL is configured.

It listens on a unix socket in the data directory only (no TCP port), keeps no snapshot on disk
and stops with the process that started it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis


class RedisUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def private_redis(data_dir: Path, timeout: float = 10.0) -> Iterator[str]:
    """Start redis-server on a unix socket under `data_dir`; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisUnavailable(
            "redis-server is not installed: install it (apt-get install redis-server) "
            "or point LORAMUX_REDIS_URL at a Redis server"
        )
    folder = data_dir / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    socket = folder / "redis.sock"
    socket.unlink(missing_ok=True)
    args = [
        binary,
        "--port",
        "0",
        "--unixsocket",
        str(socket),
        "--unixsocketperm",
        "700",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(folder),
        "--daemonize",
        "no",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"unix://{socket}"
    try:
        _wait_ready(url, proc, timeout)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RedisUnavailable(f"redis-server exited at start: {err.strip()}")
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RedisUnavailable(f"redis-server did not answer within {timeout} s")
