"""Compose a gateway process: children, engine client, state, app — `loramux serve` and tests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.service.runner import start_in_thread
from gateway.app import create_app
from gateway.engine_child import engine_child
from gateway.engine_client.base import EngineClient
from gateway.engine_client.local import LocalEngineClient
from gateway.engine_client.remote import RemoteEngineClient
from gateway.redis_server import redis_child
from gateway.settings import Settings
from gateway.state import GatewayState, build_state
from gateway.supervisor import Supervisor

log = logging.getLogger(__name__)
T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACEFUL_SECONDS = 30
"""On stop, requests in flight get this long to finish before they are cut."""


def engine_config(settings: Settings, model_dir: Path) -> EngineConfig:
    s = settings.engine
    return EngineConfig(
        model=model_dir,
        dtype=s.dtype,
        device=s.device,
        kv_cache_bytes=s.kv_cache_mb << 20,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len,
        max_loras=s.max_loras,
        max_cpu_loras=s.max_cpu_loras,
        max_lora_rank=s.max_lora_rank,
    )


def engine_client(settings: Settings, model_dir: Path) -> EngineClient:
    """The in-process engine, or the remote engines named by LORAMUX_ENGINE_URLS."""
    if settings.server.engine_urls:
        return RemoteEngineClient(list(settings.server.engine_urls), settings.server.engine_token)
    return LocalEngineClient(
        AsyncEngine.from_config(engine_config(settings, model_dir)), settings.model_name
    )


async def serve_forever(settings: Settings, model_dir: Path, host: str, port: int) -> None:
    """Run `loramux serve` until SIGTERM or SIGINT: the private redis-server (unless
    LORAMUX_REDIS_URL) and the engine (unless LORAMUX_ENGINE_URLS) as supervised children, then
    the gateway. However it ends, no child outlives it (gateway.supervisor)."""
    with StopSignals() as stop, Supervisor() as children:
        try:
            await _serve(settings, model_dir, host, port, children, stop)
        except asyncio.CancelledError:
            if stop.received is None:
                raise
            log.info("stopped by %s while starting", stop.received.name)


async def _serve(
    settings: Settings,
    model_dir: Path,
    host: str,
    port: int,
    children: Supervisor,
    stop: StopSignals,
) -> None:
    from gateway.demo_setup import first_start

    redis_url = settings.server.redis_url
    if redis_url is None:
        spec, redis_url = redis_child(settings.data_dir)
        await children.start(spec)
    if settings.server.engine_urls:
        client = RemoteEngineClient(list(settings.server.engine_urls), settings.server.engine_token)
    else:
        engine = engine_child(settings)
        await children.start(engine.spec)
        client = RemoteEngineClient([engine.url], engine.token)
    state = await build_state(settings, client, model_dir, redis_url)
    state.children = children
    await first_start(state, model_dir)
    config = uvicorn.Config(
        create_app(state),
        host=host,
        port=port,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
    )
    await stop.serve(_Server(config))


class _Server(uvicorn.Server):
    """uvicorn without signal handlers of its own: StopSignals owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class StopSignals:
    """SIGTERM and SIGINT stop serve. While it starts they cancel the start; while the HTTP
    server runs they ask it to shut down gracefully (a second signal forces it). Either way serve
    then stops its children.

    uvicorn's own handlers are not used: after shutting down they re-raise the signal, whose
    default action killed serve before it could stop its children."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    async def serve(self, server: uvicorn.Server) -> None:
        self._server = server
        server.should_exit = self.received is not None
        await server.serve()

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            if self._server is not None:
                self._server.force_exit = True
            return
        self.received = signal.Signals(signum)
        log.info("received %s: stopping", self.received.name)
        if self._server is not None:
            self._server.should_exit = True
        elif self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)


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
        create_app(state), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread, port = start_in_thread(server, loop)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", state, server, thread, loop)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
