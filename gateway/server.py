"""Compose a gateway in this process — engine client, state, app on a thread — for tests and
benchmarks. `loramux serve` is gateway.serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.http_heads import head_limited_http
from loramux.gateway.app import create_app
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.engine_client.local import LocalEngineClient
from loramux.gateway.settings import Settings
from loramux.gateway.state import GatewayState, build_state

log = logging.getLogger(__name__)
T = TypeVar("T")


def engine_client(settings: Settings, model_dir: Path) -> EngineClient:
    """The in-process engine, or the remote engines named by LORAMUX_ENGINE_URLS."""
    if settings.server.engine_urls:
        from loramux.gateway.engine_client.remote import RemoteEngineClient

        server = settings.server
        return RemoteEngineClient(
            list(server.engine_urls), server.engine_token, server.engine_first_output_seconds
        )
    return LocalEngineClient(
        AsyncEngine.from_config(settings.engine.engine_config(model_dir)), settings.model_name
    )


def start_in_thread(
    server: uvicorn.Server, loop: asyncio.AbstractEventLoop
) -> tuple[threading.Thread, int]:
    """Run `server` on a daemon thread on `loop`; return once it listens, with the thread and
    the port it got."""
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server failed to start")
        threading.Event().wait(0.02)
    return thread, int(server.servers[0].sockets[0].getsockname()[1])


@dataclass
class RunningServer:
    url: str
    state: GatewayState
    server: uvicorn.Server
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the server's event loop (for tests that touch the state)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)


@contextlib.contextmanager
def serve_in_thread(
    settings: Settings,
    client: EngineClient,
    model_dir: Path,
    port: int = 0,
    *,
    redis_url: str,
) -> Iterator[RunningServer]:
    """Start a gateway on 127.0.0.1 in a background thread; stop it on exit."""
    loop = asyncio.new_event_loop()
    state = loop.run_until_complete(build_state(settings, client, model_dir, redis_url))
    config = uvicorn.Config(
        create_app(state),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
        http=head_limited_http(settings.server.max_header_kb),
    )
    server = uvicorn.Server(config)
    thread, port = start_in_thread(server, loop)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", state, server, thread, loop)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
