"""The engine as a child process of `loramux serve`: `loramux engine` (engine.service) on an
`ipc://` socket in the data directory, behind a token generated for this serve process alone,
with its health endpoint on a port of 127.0.0.1.

Serve reaches it with the remote engine client, the same way it reaches engines named by
LORAMUX_ENGINE_URLS. The socket path and token are chosen once, so a restarted engine answers at
the same address; adapters it served before are uploaded to it again on demand
(gateway.engine_client.remote), from the gateway's adapter store.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from loramux.gateway.serve_workers import available_cores
from loramux.gateway.settings import Settings
from loramux.gateway.supervisor import ChildSpec

START_SECONDS = 900.0
"""How long an engine may take to load its model and answer /health (a large model on a GPU
takes minutes); past it, it is killed and started again."""
MAX_IPC_PATH = 100
"""A Unix socket's path has room for 107 bytes; a deeper data directory gets a temporary one."""


@dataclass(frozen=True)
class EngineChild:
    spec: ChildSpec
    url: str
    token: str


def engine_child(settings: Settings, workers: int) -> EngineChild:
    """The engine's child spec; it gets the cores `workers` gateway processes leave unless the
    settings (LORAMUX_ENGINE_THREADS) say otherwise."""
    url = f"ipc://{_socket_path(settings.data_dir)}"
    health = f"http://127.0.0.1:{_free_loopback_port()}"
    token = secrets.token_urlsafe(32)
    argv: tuple[str, ...] = (
        sys.executable,
        "-m",
        "loramux.gateway.cli",
        "engine",
        "--address",
        url,
    )
    argv += ("--health-port", health.rsplit(":", 1)[1], "--log-level", "warning")
    env = {k: v for k, v in os.environ.items() if k != "LORAMUX_ENGINE_URLS"}
    env |= {"LORAMUX_ENGINE_TOKEN": token, "LORAMUX_DATA_DIR": str(settings.data_dir)}
    threads = settings.engine.engine_threads  # never 0: the settings refuse it
    env["LORAMUX_ENGINE_THREADS"] = str(engine_threads(workers) if threads is None else threads)

    async def ready() -> bool:
        async with httpx.AsyncClient(timeout=2.0) as client:  # /health needs no token
            return (await client.get(f"{health}/health")).status_code == 200

    return EngineChild(ChildSpec("engine", argv, ready, START_SECONDS, env), url, token)


def engine_threads(workers: int) -> int:
    """The engine's torch threads beside `workers` gateway processes: the cores they leave, at
    least one. With every core, as torch takes by default, the engine's threads on a CPU device
    contend with each gateway's event loop for a core, and every request waits on them: on 2
    cores, 64 streams' first tokens came 0.58-0.74 of the direct time later through the gateway
    than directly, against 0.10-0.24 with the engine on 1 core (bench.gateway_overhead)."""
    return max(1, available_cores() - workers)


def _socket_path(data_dir: Path) -> Path:
    path = data_dir.resolve() / "engine.sock"
    if len(str(path)) > MAX_IPC_PATH:
        path = Path(tempfile.mkdtemp(prefix="loramux-")) / "engine.sock"
    return path


def _free_loopback_port() -> int:
    """A port no one listens on now. Another process could take it before the engine binds it;
    then the engine fails to start, and serve says so."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
