"""The gateway overhead benchmark's server side: an engine process (bench.engine_process) and a
real gateway in a thread of this process connected to it over the ZeroMQ channel, as
`loramux serve` with LORAMUX_ENGINE_URLS runs it (uvicorn on loopback, SQLite, a private
redis-server), with a tenant and API key made through the admin API."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import RunSettings
from bench.engine_process import RunningEngine, engine_process
from bench.load_generator import LoadGenerator
from loramux.engine.config import EngineConfig
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.engine_child import engine_threads
from loramux.gateway.engine_client.remote import RemoteEngineClient
from loramux.gateway.redis_server import private_redis
from loramux.gateway.server import RunningServer, serve_in_thread
from loramux.gateway.settings import ServerSettings, Settings

MODEL_NAME = "demo-model"


@dataclass(frozen=True)
class Rig:
    engine: RunningEngine
    client: RemoteEngineClient
    """The gateway's client of the engine (its stats give the engine's step counter)."""
    server: RunningServer
    key: str
    generator: LoadGenerator

    def on_loop(self, coro: Awaitable[Any]) -> Any:
        """Run a coroutine on the gateway's event loop and wait for it (no time limit)."""
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result()  # type: ignore[arg-type]

    def engine_steps(self) -> int:
        (stats,) = self.on_loop(self.client.stats())
        return int(stats.steps)


def engine_config(settings: RunSettings, model_dir: Path) -> EngineConfig:
    """The engine's config, with the threads `loramux serve --workers 1` gives its engine: the
    cores the one gateway leaves."""
    engine = settings.engine(
        max_model_len=512, max_num_seqs=64, prefix_caching=False, engine_threads=engine_threads(1)
    )
    return engine.engine_config(model_dir)


def tenant_key(server: RunningServer) -> str:
    """A new tenant and API key, made through the admin API."""
    token = server.state.admin.mint("bench-gateway-overhead", ttl_seconds=3600)
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as admin:
        tenant = admin.post("/admin/tenants", json={"name": f"bench-{uuid.uuid4().hex[:8]}"})
        tenant.raise_for_status()
        key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={"name": "bench"})
        key.raise_for_status()
        return str(key.json()["key"])


@contextlib.contextmanager
def running_rig(
    settings: RunSettings, model_dir: Path, workdir: Path, generator: LoadGenerator
) -> Iterator[Rig]:
    server_settings = ServerSettings(model_name=MODEL_NAME)
    gateway_settings = Settings(
        data_dir=workdir / "gateway", model=model_dir, server=server_settings
    )
    upgrade(gateway_settings.database_url)
    with engine_process(engine_config(settings, model_dir), MODEL_NAME, workdir) as engine:
        client = RemoteEngineClient([engine.url])
        with (
            private_redis(gateway_settings.data_dir) as redis_url,
            serve_in_thread(gateway_settings, client, model_dir, redis_url=redis_url) as server,
        ):
            yield Rig(engine, client, server, tenant_key(server), generator)
