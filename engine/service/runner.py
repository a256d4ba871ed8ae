"""Run the engine service: in the foreground (`loramux engine`) or on a thread (tests,
benchmarks). Both serve the channel (engine.service.server) and the health endpoint
(engine.service.health) from one event loop; the step loop runs on its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.http_heads import MAX_HEAD_KB, head_limited_http
from loramux.engine.service.health import create_health_app
from loramux.engine.service.server import HEARTBEAT_TIMEOUT_MS, EngineServer
from loramux.engine.service.uploads import MAX_ADAPTER_MB

log = logging.getLogger(__name__)

NR_OPEN = 1 << 20
"""The kernel's usual cap on a process's open files (fs.nr_open), taken for an unlimited hard
limit, which a soft limit cannot be."""


@dataclass(frozen=True)
class Listen:
    address: str
    """Where gateways connect: `ipc:///path/engine.sock` or `tcp://host:port`."""
    health_host: str = "127.0.0.1"
    health_port: int = 0
    """The HTTP health and metrics endpoint; 0 picks a free port."""
    metrics_token: str | None = None
    """LORAMUX_METRICS_TOKEN: /metrics answers only `Bearer <token>` (engine.service.health)."""
    max_head_kb: int = MAX_HEAD_KB
    """LORAMUX_MAX_HEADER_KB: the longest head (request line and headers) the endpoint reads."""


async def serve_engine(
    engine: AsyncEngine,
    model_name: str,
    listen: Listen,
    *,
    adapter_dir: Path | None = None,
    token: str | None = None,
    log_level: str = "warning",
    ready: threading.Event | None = None,
    bound: list[str] | None = None,
    stop: asyncio.Event | None = None,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    max_adapter_mb: int = MAX_ADAPTER_MB,
) -> None:
    """Serve until the health server exits (a signal, in the foreground) or `stop` is set;
    then shut the engine down. Once listening, the channel's address and the health URL are
    appended to `bound` and `ready` is set."""
    server = EngineServer(
        engine,
        model_name,
        token,
        adapter_dir,
        max_adapter_mb=max_adapter_mb,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    address = server.bind(listen.address)
    config = uvicorn.Config(
        create_health_app(engine, listen.metrics_token),
        host=listen.health_host,
        port=listen.health_port,
        log_level=log_level,
        lifespan="off",
        http=head_limited_http(listen.max_head_kb),
    )
    health = uvicorn.Server(config)
    engine.start()
    web = asyncio.create_task(health.serve())
    channel: asyncio.Task[None] | None = None
    try:
        while not health.started:
            if web.done():
                await web  # it failed to start: raise why
                return
            await asyncio.sleep(0.01)
        # Gateways get answers only once /health says the engine is up, so a gateway never
        # finds the engine ready before its supervisor does (messages wait in the socket).
        channel = asyncio.create_task(server.serve())
        port = health.servers[0].sockets[0].getsockname()[1]
        if bound is not None:
            bound += [address, f"http://{listen.health_host}:{port}"]
        if ready is not None:
            ready.set()
        waits: set[asyncio.Future[Any]] = {web, channel}
        if stop is not None:
            waits.add(asyncio.ensure_future(stop.wait()))
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is channel:
                task.result()  # the channel failed: raise why
    finally:
        health.should_exit = True
        if channel is not None:
            channel.cancel()
        await asyncio.gather(web, *([channel] if channel else []), return_exceptions=True)
        server.close()
        await asyncio.to_thread(engine.shutdown)


def run_engine_service(
    config: EngineConfig,
    model_name: str,
    listen: Listen,
    *,
    adapter_dir: Path,
    token: str | None = None,
    log_level: str = "info",
) -> None:
    """Build the engine from `config` and serve it until interrupted (blocks). The process is the
    engine's own: its torch gets `config.cpu_threads` threads, and it may open as many files as
    its hard limit allows."""
    use_cpu_threads(config)
    raise_open_file_limit()
    engine = AsyncEngine.from_config(config)
    asyncio.run(
        serve_engine(
            engine, model_name, listen, adapter_dir=adapter_dir, token=token, log_level=log_level
        )
    )


def raise_open_file_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (logged). Every
    connection to the channel holds a descriptor until its handshake ends or fails (at most
    engine.service.server's HANDSHAKE_MS): at a service's usual soft limit of 1,024, a peer
    without a key holding that many idle connections left the engine none for its gateways.
    The channel's tcp:// port should still be reachable from the gateways' hosts alone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = NR_OPEN if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft >= wanted:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open files limit from %d to %d: %s", soft, wanted, exc)
        return
    log.info("raised the open files limit from %d to %d (the hard limit)", soft, wanted)


def use_cpu_threads(config: EngineConfig) -> None:
    """Give this process's torch `config.cpu_threads` intra-op threads (None leaves its default,
    every core). Process-wide: only for a process that is the engine's own."""
    if config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)


@dataclass
class RunningEngineService:
    url: str
    """The channel's address, e.g. `tcp://127.0.0.1:41234`."""
    health_url: str
    engine: AsyncEngine
    thread: threading.Thread
    _loop: asyncio.AbstractEventLoop
    _stop: asyncio.Event

    def stop(self) -> None:
        """Stop serving and shut the engine down; gateways connected to it see it go."""
        self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=30)


@contextlib.contextmanager
def serve_engine_in_thread(
    engine: AsyncEngine,
    model_name: str,
    *,
    address: str = "tcp://127.0.0.1:0",
    adapter_dir: Path | None = None,
    token: str | None = None,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    max_adapter_mb: int = MAX_ADAPTER_MB,
) -> Iterator[RunningEngineService]:
    """Serve `engine` from a background thread (on a free loopback port unless `address`
    says otherwise); stop it on exit."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()
    bound: list[str] = []
    work = serve_engine(
        engine,
        model_name,
        Listen(address),
        adapter_dir=adapter_dir,
        token=token,
        ready=ready,
        bound=bound,
        stop=stop,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        max_adapter_mb=max_adapter_mb,
    )
    thread = threading.Thread(target=loop.run_until_complete, args=(work,), daemon=True)
    thread.start()
    while not ready.wait(0.02):
        if not thread.is_alive():
            raise RuntimeError("the engine service failed to start")
    running = RunningEngineService(bound[0], bound[1], engine, thread, loop, stop)
    try:
        yield running
    finally:
        running.stop()
