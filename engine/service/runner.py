"""Run the engine service: in the foreground (`loramux engine`) or on a thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.service.app import create_engine_app

KEEP_ALIVE_SECONDS = 60
"""Idle connections are kept this long, longer than gateways keep them, so a gateway never
sends on a connection the engine is closing."""


def run_engine_service(
    config: EngineConfig,
    model_name: str,
    host: str,
    port: int,
    *,
    adapter_dir: Path,
    token: str | None = None,
    log_level: str = "info",
) -> None:
    """Build the engine from `config` and serve it until interrupted (blocks)."""
    engine = AsyncEngine.from_config(config)
    app = create_engine_app(engine, model_name, adapter_dir=adapter_dir, token=token)
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_SECONDS
    )


@dataclass
class RunningEngineService:
    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        """Stop serving and shut the engine down; later connections are refused."""
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_in_thread(
    server: uvicorn.Server, loop: asyncio.AbstractEventLoop | None = None
) -> tuple[threading.Thread, int]:
    """Run `server` on a daemon thread (on `loop` when given, else a new one); return once it
    listens, with the thread and the port it got."""
    loop = loop or asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server failed to start")
        threading.Event().wait(0.02)
    return thread, int(server.servers[0].sockets[0].getsockname()[1])


@contextlib.contextmanager
def serve_engine_in_thread(
    engine: AsyncEngine,
    model_name: str,
    *,
    adapter_dir: Path | None = None,
    token: str | None = None,
) -> Iterator[RunningEngineService]:
    """Serve `engine` on a free port of 127.0.0.1 from a background thread; stop it on exit."""
    app = create_engine_app(engine, model_name, adapter_dir=adapter_dir, token=token)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", timeout_keep_alive=KEEP_ALIVE_SECONDS
    )
    server = uvicorn.Server(config)
    thread, port = start_in_thread(server)
    running = RunningEngineService(f"http://127.0.0.1:{port}", engine, server, thread)
    try:
        yield running
    finally:
        running.stop()
