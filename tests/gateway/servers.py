"""Servers for gateway tests: a gateway on loopback, engine services, and a TCP relay that can
cut every connection through it (a network failure between a gateway and its engine, or its
Redis)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.service import serve_engine_in_thread
from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import Settings

ENGINE_TOKEN = "shared-secret"


def demo_env(model_dir: Path, **more: str) -> dict[str, str]:
    """The `LORAMUX_*` variables of a test's server on the demo model (a small context and KV
    pool), with `more` added."""
    return {
        "LORAMUX_MODEL": str(model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_MAX_MODEL_LEN": "512",
        "LORAMUX_KV_CACHE_MB": "32",
        **more,
    }


@contextlib.contextmanager
def gateway_server(
    model_dir: Path,
    data_dir: Path,
    redis_url: str,
    client: Callable[[Settings], EngineClient] | None = None,
) -> Iterator[RunningServer]:
    """A gateway on 127.0.0.1 with its SQLite database in `data_dir`, serving the demo model
    through the in-process engine, or through `client(settings)` when given."""
    env = demo_env(model_dir, LORAMUX_DATA_DIR=str(data_dir), LORAMUX_KEY_CACHE_SECONDS="0.5")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = Settings()
        upgrade(settings.database_url)
        engine = client(settings) if client else engine_client(settings, model_dir)
        with serve_in_thread(settings, engine, model_dir, redis_url=redis_url) as server:
            yield server
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def engine_service(
    model_dir: Path, adapter_dir: Path, address: str = "tcp://127.0.0.1:0"
) -> Iterator[RunningEngineService]:
    """An engine service for the demo model on a thread, guarded by ENGINE_TOKEN."""
    config = EngineConfig(model=model_dir, max_model_len=512, kv_cache_bytes=16 << 20)
    engine = AsyncEngine(LLMEngine(config))
    with serve_engine_in_thread(
        engine, "demo", address=address, adapter_dir=adapter_dir, token=ENGINE_TOKEN
    ) as service:
        yield service


class TcpRelay:
    """Relays TCP connections from a port of 127.0.0.1 to `target`; `cut()` closes every
    connection under way, as a network failure would; `block()` also refuses new ones until
    `unblock()` (a failure that lasts); `stall()` keeps every connection open but forwards
    nothing until `flow()` (a partition that drops packets, no reset). `seen` keeps every byte relayed, both ways: what an
    eavesdropper on the network reads."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._relayed = threading.Condition(self._lock)
        self.seen = bytearray()
        self.blocked = False
        self._flowing = threading.Event()
        self._flowing.set()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def wait_seen(self, marker: bytes, after: int = 0, timeout: float = 30) -> None:
        """Returns once `marker` has been relayed at or past offset `after` of `seen` (blocks:
        call it on a thread from async code)."""
        with self._relayed:
            if not self._relayed.wait_for(lambda: marker in self.seen[after:], timeout):
                raise TimeoutError(f"{marker!r} was not relayed within {timeout} s")

    def block(self) -> None:
        self.blocked = True
        self.cut()

    def unblock(self) -> None:
        self.blocked = False

    def stall(self) -> None:
        self._flowing.clear()

    def flow(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self._listener.accept()
            except OSError:
                return
            if self.blocked:
                inbound.close()
                continue
            outbound = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [inbound, outbound]
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self._flowing.wait()
                with self._lock:
                    self.seen += data
                    self._relayed.notify_all()
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
