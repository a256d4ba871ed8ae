"""`loramux serve`: the gateway with its private redis-server (unless LORAMUX_REDIS_URL) and its
engine process (unless LORAMUX_ENGINE_URLS) as supervised children, one process tree that stops
as a whole (gateway.supervisor).

Start: redis-server and the engine are spawned first; while the engine loads its model, this
process imports the gateway and migrates the database (each takes seconds, so they overlap); the
gateway starts serving once both children are ready. Stop: SIGTERM or SIGINT lets requests in
flight finish (up to GRACEFUL_SECONDS), then stops the children.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from gateway.engine_child import engine_child
from gateway.redis_server import redis_child
from gateway.settings import Settings
from gateway.supervisor import SupervisedChild, Supervisor

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACEFUL_SECONDS = 30
"""On stop, requests in flight get this long to finish before they are cut."""


async def serve_forever(settings: Settings, model_dir: Path, host: str, port: int) -> None:
    """Run until SIGTERM or SIGINT; however it ends, no child outlives it."""
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
    starting: list[SupervisedChild] = []
    redis_url = settings.server.redis_url
    if redis_url is None:
        spec, redis_url = redis_child(settings.data_dir)
        starting.append(children.spawn(spec))
    engine_urls, engine_token = list(settings.server.engine_urls), settings.server.engine_token
    if not engine_urls:
        engine = engine_child(settings)
        starting.append(children.spawn(engine.spec))
        engine_urls, engine_token = [engine.url], engine.token

    # Imported now, after the children were spawned, so that importing the gateway (torch,
    # sentence-transformers: seconds) overlaps the engine's start; on a thread, so that the
    # event loop meanwhile handles a stop at once.
    await asyncio.to_thread(importlib.import_module, "gateway.app")
    from gateway.app import create_app
    from gateway.db.migrate import upgrade
    from gateway.demo_setup import first_start
    from gateway.engine_client.remote import RemoteEngineClient
    from gateway.state import build_state

    await asyncio.to_thread(upgrade, settings.database_url)  # it runs an event loop of its own
    for child in starting:
        await child.started()
    state = await build_state(
        settings, RemoteEngineClient(engine_urls, engine_token), model_dir, redis_url
    )
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
