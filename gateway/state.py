"""Everything a gateway process holds: settings, database, engine client, auth, catalog, metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import BlockingConnectionPool, Redis
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.peft_format import AdapterLimits
from loramux.adapters.store import AdapterStore
from loramux.cache.embedder import Embedder
from loramux.cache.response_cache import ResponseCache
from loramux.gateway import tracing
from loramux.gateway.access_log import redact_access_log
from loramux.gateway.adapters.shared_store import SharedAdapterStore
from loramux.gateway.adapters.sweep import sweep_leftovers
from loramux.gateway.auth.admin_jwt import AdminAuth
from loramux.gateway.auth.admin_key import admin_public_key_pem
from loramux.gateway.auth.api_keys import ApiKeyAuth
from loramux.gateway.catalog import ModelCatalog
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.engine_client.base import EngineClient, EngineInfo
from loramux.gateway.metrics import Metrics
from loramux.gateway.prompt_tokens import PromptTokens
from loramux.gateway.quotas import QuotaService
from loramux.gateway.runs_in_flight import RunsInFlight
from loramux.gateway.served_identity import ServedIdentity, confirm_identity, engine_info
from loramux.gateway.setting_checks import check_admin_secret
from loramux.gateway.settings import Settings, private_folder
from loramux.gateway.supervisor import Supervisor
from loramux.gateway.usage import UsageRecorder

log = logging.getLogger(__name__)

RUNS_END_SECONDS = 5.0
"""At shutdown, how long the engine runs of requests cut at the end of the grace period get to
end (aborted) and be metered before the usage recorder closes."""
USAGE_CLOSE_SECONDS = 10.0
"""At shutdown, how long the usage recorder retries writing to a database that is unavailable."""


@dataclass
class GatewayState:
    settings: Settings
    db: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    engine: EngineClient
    keys: ApiKeyAuth
    admin: AdminAuth
    catalog: ModelCatalog
    store: AdapterStore
    metrics: Metrics
    usage: UsageRecorder
    model_name: str
    identity: ServedIdentity
    """The base model's files and dtype and the engine's code, as the engine digested them."""
    assumed: EngineInfo
    """What the engine said it serves at the start, or what the gateway assumed without it."""
    max_model_len: int
    prompts: PromptTokens
    """Tokenizes prompts and detokenizes outputs: the engine takes and gives token ids."""
    redis: Redis
    """Quota state (rate windows, concurrency leases, budget ledgers): must never evict."""
    cache_redis: Redis
    """The response cache's: LORAMUX_CACHE_REDIS_URL, else the same client as `redis`."""
    cache: ResponseCache
    quotas: QuotaService
    children: Supervisor | None = None
    """The child processes `loramux serve` supervises (for /health); None in other setups."""
    shared_store: SharedAdapterStore | None = None
    """Where uploads also go for engine replicas on other machines (LORAMUX_ADAPTER_STORE_URL)."""
    sweeping: asyncio.Task[list[str]] | None = None
    """The start's sweep of adapter files dead processes left (gateway.adapters.sweep)."""
    confirming: asyncio.Task[None] | None = None
    """Asks an engine that did not answer at the start for its identity (gateway.served_identity)."""
    runs: RunsInFlight = field(default_factory=RunsInFlight)
    """The engine runs of completions, until each has ended (and been metered)."""

    async def start(self) -> None:
        """Start background tasks (on the serving event loop), after the server has set up its
        logging: from here on its access log carries no query values."""
        redact_access_log()
        self.usage.start()
        await self.cache.start()
        self.sweeping = asyncio.ensure_future(sweep_leftovers(self))
        if not self.identity.confirmed:
            self.confirming = asyncio.ensure_future(
                confirm_identity(self.engine, self.identity, self.assumed)
            )

    async def close(self) -> None:
        """Stop background work, end the runs still going, then write what is buffered (usage,
        quota settlements, cache stores) and close every connection. Bounded: at most about
        RUNS_END_SECONDS + USAGE_CLOSE_SECONDS, whatever is down."""
        for task in (self.sweeping, self.confirming):
            if task is not None:
                task.cancel()
        # Runs the HTTP server cut (their requests outlived the grace period) are metered and
        # settled as they end: before quotas and usage close.
        await self.runs.end(RUNS_END_SECONDS)
        await self.quotas.close()
        await self.cache.drain()
        self.cache.deleted_tenants.cancel()
        await self.usage.close(USAGE_CLOSE_SECONDS)
        await self.engine.close()
        self.prompts.close()
        await self.redis.aclose()
        if self.cache_redis is not self.redis:
            await self.cache_redis.aclose()
        if self.shared_store is not None and self.shared_store.engine is not self.db:
            await self.shared_store.close()
        await self.db.dispose()


def shared_store(settings: Settings, db: AsyncEngine) -> SharedAdapterStore | None:
    """The shared adapter store, on the gateway's own database engine when it is that database."""
    url = settings.shared_adapter_store_url
    if url is None:
        return None
    return (
        SharedAdapterStore(db) if url == settings.database_url else SharedAdapterStore.from_url(url)
    )


def admin_secret(settings: Settings) -> str:
    """LORAMUX_ADMIN_SECRET, else a secret generated once and kept in the data directory."""
    if settings.server.admin_secret:
        return settings.server.admin_secret
    path = settings.data_dir / "admin_secret"
    if not path.is_file():
        private_folder(settings.data_dir)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48))
    secret = path.read_text().strip()
    check_admin_secret(secret, str(path))
    return secret


def admin_auth(settings: Settings) -> AdminAuth:
    max_ttl = settings.server.admin_token_max_ttl
    if settings.server.admin_public_key:
        pem = admin_public_key_pem(settings.server.admin_public_key)
        return AdminAuth(None, "RS256", pem, max_ttl=max_ttl)
    return AdminAuth(admin_secret(settings), "HS256", max_ttl=max_ttl)


def redis_client(url: str, max_connections: int = 1024) -> Redis:
    """A shared client whose pool waits for a free connection instead of failing when many
    requests are in flight (redis-py's default pool raises past 100)."""
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=5)
    return Redis(connection_pool=pool)


async def build_state(
    settings: Settings, engine: EngineClient, model_dir: Path, redis_url: str
) -> GatewayState:
    """Connect everything; the database must already be migrated (`loramux migrate`)."""
    private_folder(settings.data_dir)
    db = create_engine(settings.database_url)
    sessions = session_factory(db)
    tracing.configure()
    await engine.start()
    info, identity = await engine_info(engine, settings, model_dir)
    redis = redis_client(redis_url)
    cache_url = settings.cache.redis_url
    cache_redis = redis_client(cache_url) if cache_url and cache_url != redis_url else redis
    base = BaseModelSpec.from_model_dir(model_dir)
    limits = AdapterLimits(
        max_rank=settings.engine.max_lora_rank, max_file_bytes=settings.server.max_upload_mb << 20
    )
    usage = UsageRecorder(
        sessions,
        interval=settings.server.usage_flush_seconds,
        max_buffered=settings.server.usage_max_buffered,
    )
    return GatewayState(
        settings=settings,
        db=db,
        sessions=sessions,
        engine=engine,
        keys=ApiKeyAuth(sessions, ttl=settings.server.key_cache_seconds),
        admin=admin_auth(settings),
        catalog=ModelCatalog(sessions, info.model_name),
        store=AdapterStore(settings.adapter_dir, base, limits),
        shared_store=shared_store(settings, db),
        metrics=Metrics(),
        usage=usage,
        model_name=info.model_name,
        identity=identity,
        assumed=info,
        max_model_len=info.max_model_len,
        prompts=PromptTokens(model_dir, info.vocab_size, info.max_model_len),
        redis=redis,
        cache_redis=cache_redis,
        cache=ResponseCache(
            cache_redis,
            Embedder(),
            max_entries_per_bucket=settings.cache.max_entries_per_bucket,
            mirror_bytes=settings.cache.mirror_mb << 20,
            redis_timeout=settings.cache.redis_timeout_ms / 1000,
        ),
        quotas=QuotaService(redis, sessions, settings.quotas, usage=usage),
    )
