"""`loramux serve`: the gateway with its private redis-server (unless LORAMUX_REDIS_URL) and its
engine process (unless LORAMUX_ENGINE_URLS) as supervised children, one process tree that stops
as a whole (gateway.supervisor).

Start: redis-server and the engine are spawned first; while the engine loads its model, this
process imports the gateway and migrates the database (each takes seconds, so they overlap); the
gateway starts serving once both children are ready. Stop: SIGTERM or SIGINT lets requests in
flight finish (up to LORAMUX_STOP_GRACE_SECONDS), then stops the children.

With `--workers N` (N > 1) the gateway itself runs as N supervised worker processes sharing the
port that serve bound (gateway.serve_workers); this process then only supervises.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import uvicorn

from loramux.engine.http_heads import head_limited_http
from loramux.gateway.engine_child import engine_child
from loramux.gateway.redis_server import redis_child
from loramux.gateway.serve_workers import (
    MULTIPROCESS_DIR,
    control_socket,
    listening_socket,
    metrics_folder,
    worker_child,
)
from loramux.gateway.setting_checks import StartError
from loramux.gateway.settings import Settings
from loramux.gateway.supervisor import SupervisedChild, Supervisor

log = logging.getLogger(__name__)

LOCK_FILE = "serve.lock"
"""In the data directory: locked (flock) by the serve that runs on it, and holding its pid."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CLOSE_SECONDS = 20.0
"""How long a gateway may take to close once its grace period is over (GatewayState.close: the
runs it cut end and are billed, its usage is written: at most RUNS_END_SECONDS +
USAGE_CLOSE_SECONDS there). Serve gives its workers this long beyond the grace period before it
kills them, which lost the usage they held."""


@dataclass(frozen=True)
class Bind:
    host: str
    port: int
    workers: int = 1
    """Gateway processes; with more than one, each is a child (gateway.serve_workers)."""
    listen_fd: int | None = None
    """A worker's listening socket: its parent's port, inherited as this descriptor."""
    control_socket: Path | None = None
    """A worker's own Unix socket, where its parent probes it."""

    @property
    def url(self) -> str:
        """Where clients reach this serve (for the first start's example request)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@contextlib.contextmanager
def claim_data_dir(data_dir: Path) -> Iterator[None]:
    """Hold the data directory for this serve (a flock on LOCK_FILE, with this pid written in
    it) until the block ends; a StartError at once, naming the pid, when another serve holds it.
    Two serves on one data directory would start redis-server and the engine on the same socket
    paths, and the second, stopping, left the first without a Redis socket. The kernel drops the
    lock when this process exits, however it exits; the file stays (unlinking it would race a
    serve starting)."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise StartError(
                f"the data directory {data_dir} (LORAMUX_DATA_DIR) is in use by another loramux "
                f"serve, pid {holder}: stop it, or give this one a data directory of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


async def serve_forever(settings: Settings, model_dir: Path, bind: Bind) -> None:
    """Run until SIGTERM or SIGINT; however it ends, no child outlives it. An OSError before
    the gateway serves (a folder it cannot make, no file descriptors left) is a StartError: the
    operator's to fix, said in one line."""
    with (
        _listening(bind) as sockets,
        StopSignals() as stop,
        Supervisor() as children,
    ):
        try:
            await _serve(settings, model_dir, bind, sockets, children, stop)
        except asyncio.CancelledError:
            if stop.received is None:
                raise
            log.info("stopped by %s", stop.received.name)
        except OSError as exc:
            if stop.serving:
                raise
            raise StartError(f"could not start: {exc}") from exc


@contextlib.contextmanager
def _listening(bind: Bind) -> Iterator[list[socket.socket]]:
    """The sockets this serve listens on, from before anything starts until it exits: its port
    (bound here, or a worker's inherited from its parent), then a worker's control socket."""
    with contextlib.ExitStack() as sockets:
        if bind.listen_fd is None:
            port = listening_socket(bind.host, bind.port)
        else:
            port = socket.socket(fileno=bind.listen_fd)
        listening = [sockets.enter_context(port)]
        if bind.control_socket is not None:
            listening.append(sockets.enter_context(control_socket(bind.control_socket)))
        yield listening


async def _serve(
    settings: Settings,
    model_dir: Path,
    bind: Bind,
    sockets: list[socket.socket],
    children: Supervisor,
    stop: StopSignals,
) -> None:
    starting: list[SupervisedChild] = []
    redis_url = settings.server.redis_url
    if redis_url is None:
        spec, redis_url = redis_child(settings.data_dir)
        starting.append(children.spawn(spec))
    if not settings.server.engine_urls:  # from here on, settings name the engine child
        engine = engine_child(settings, bind.workers)
        starting.append(children.spawn(engine.spec))
        server = replace(settings.server, engine_urls=(engine.url,), engine_token=engine.token)
        settings = replace(settings, server=server)
    if bind.workers > 1:
        shared = _shared_with_workers(settings, redis_url)
        await _supervise_workers(settings, bind, sockets[0], starting, children, shared, stop)
        return

    # Imported now, after the children were spawned, so that importing the gateway (torch,
    # sentence-transformers: seconds) overlaps the engine's start; on a thread, so that the
    # event loop meanwhile handles a stop at once.
    await asyncio.to_thread(importlib.import_module, "loramux.gateway.app")
    from loramux.gateway.app import create_app
    from loramux.gateway.db.migrate import upgrade
    from loramux.gateway.demo_setup import first_start
    from loramux.gateway.server import engine_client
    from loramux.gateway.state import build_state

    await asyncio.to_thread(upgrade, settings.database_url)  # it runs an event loop of its own
    for child in starting:
        await child.started()
    state = await build_state(settings, engine_client(settings, model_dir), model_dir, redis_url)
    state.children = children
    await first_start(state, model_dir, bind.url)
    config = uvicorn.Config(
        create_app(state),
        host=bind.host,
        port=bind.port,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=settings.server.stop_grace_seconds,
        http=head_limited_http(settings.server.max_header_kb),
    )
    await stop.serve(_Server(config), sockets)


def _shared_with_workers(settings: Settings, redis_url: str) -> dict[str, str]:
    """What the workers take from their parent: its redis-server and engine (as external
    ones, LORAMUX_* variables) and the folder of their metrics."""
    urls, token = settings.server.engine_urls, settings.server.engine_token
    shared = {"LORAMUX_REDIS_URL": redis_url, "LORAMUX_ENGINE_URLS": ",".join(urls)}
    if token is not None:
        shared["LORAMUX_ENGINE_TOKEN"] = token
    shared[MULTIPROCESS_DIR] = str(metrics_folder(settings.data_dir))
    return shared


async def _supervise_workers(
    settings: Settings,
    bind: Bind,
    port: socket.socket,
    starting: list[SupervisedChild],
    children: Supervisor,
    shared: dict[str, str],
    stop: StopSignals,
) -> None:
    """Start the workers, serving on `port`, once redis-server and the engine are up (worker 0
    first and alone: it migrates the database and runs the first-start setup), then supervise
    until stopped. On stop the workers go first, letting their requests in flight finish (a
    second signal goes on to them: they cut their requests), then the engine and Redis."""
    for child in starting:
        await child.started()
    specs = [
        worker_child(i, bind.host, bind.port, port.fileno(), settings.data_dir, shared)
        for i in range(bind.workers)
    ]
    workers = [children.spawn(specs[0])]
    stop.forward_to(workers)
    try:
        await workers[0].started()
        workers += [children.spawn(spec) for spec in specs[1:]]
        for worker in workers[1:]:
            await worker.started()
        log.info("%d gateway workers serve on %s:%d", bind.workers, bind.host, bind.port)
        await asyncio.Event().wait()  # until a stop signal cancels this task
    finally:
        # The workers' copies of the port go as each stops listening: then the port is closed
        # and refuses new connections, instead of queueing them for no worker until serve exits.
        port.close()
        grace = settings.server.stop_grace_seconds
        await asyncio.to_thread(children.stop, workers, grace + CLOSE_SECONDS)


class _Server(uvicorn.Server):
    """uvicorn without signal handlers of its own: StopSignals owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, except that a forced exit (a second signal) cuts the requests in flight
        and still shuts the gateway down: uvicorn skips the lifespan shutdown then, and with it
        GatewayState.close, which bills the runs cut and writes the usage held (all lost)."""
        await super().shutdown(sockets)
        if self.force_exit:
            for task in self.server_state.tasks:
                task.cancel(msg="a second stop signal cut the request")
            await self.lifespan.shutdown()  # returns at once if it already ran


class StopSignals:
    """SIGTERM and SIGINT stop serve. While it starts they cancel the start; while the HTTP
    server runs they ask it to shut down gracefully (a second signal forces it), and so do the
    gateway workers (`forward_to`) once serve stops them. Either way serve then stops its
    children.

    uvicorn's own handlers are not used: after shutting down they re-raise the signal, whose
    default action killed serve before it could stop its children."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._forwarded: list[SupervisedChild] = []

    def __enter__(self) -> StopSignals:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def serving(self) -> bool:
        """The HTTP server was started: serve is past its start."""
        return self._server is not None

    def forward_to(self, children: list[SupervisedChild]) -> None:
        """Send a second signal on to `children` (gateway workers; the list as it grows), as
        SIGINT: each worker then forces its own HTTP server's exit. They run in sessions of
        their own, which a Ctrl-C in the terminal does not reach."""
        self._forwarded = children

    async def serve(self, server: uvicorn.Server, sockets: list[socket.socket] | None) -> None:
        self._server = server
        server.should_exit = self.received is not None
        await server.serve(sockets)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            if self._server is not None:
                self._server.force_exit = True
            for child in self._forwarded:
                child.send_signal(signal.SIGINT)
            return
        self.received = signal.Signals(signum)
        log.info("received %s: stopping", self.received.name)
        if self._server is not None:
            self._server.should_exit = True
        elif self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
