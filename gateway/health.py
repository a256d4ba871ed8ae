"""Liveness (/health), readiness (/ready) and Prometheus metrics.

Liveness asks "should this process be restarted?", readiness "should it get traffic?". While the
engine is down — dead and being restarted by serve, or, with LORAMUX_ENGINE_URLS, unreachable —
/ready answers 503 and /health 200 with `status: degraded`: a restart of the whole service would
only lengthen the outage. With several engines, /ready answers 200 while one of them answers
(it serves), and /health says `degraded` while one of them does not, naming which. /health
answers 503 when a supervised child keeps failing to stay up.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from litestar import Request, Response, Router, get
from litestar.di import NamedDependency, Provide
from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.cache.response_cache import ResponseCache
from loramux.engine.outputs import EngineStats
from loramux.engine.service.health import UNAUTHORIZED, scrape_allowed
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.metrics import Degradation, Metrics
from loramux.gateway.quotas import QuotaService
from loramux.gateway.state import GatewayState
from loramux.gateway.supervisor import Supervisor
from loramux.gateway.usage import UsageRecorder

T = TypeVar("T")

PROBE_INTERVAL = 0.05
"""At most this often (seconds) a worker's /health, /ready and /metrics ask the engines (and,
for /ready, the database and Redis); requests in between get the last answer."""

READY_PROBE_SECONDS = 5.0
"""How long /ready waits for each of the database, the engines and Redis before counting it as
not answering, as long as the engine client's probe and the Redis client's reads: a database
behind a network that drops packets held its SELECT 1, and with it every /ready (they share one
answer), forever."""


class Coalesced(Generic[T]):
    """The answer of `ask`, asked at most once per `min_interval` seconds: callers in between
    get the last answer, and concurrent ones share the ask under way. For the routes that need
    no credentials (Prometheus and orchestrators call them) and ask the engines: a client
    calling them without pause made every engine answer a stats or metrics call on its event
    loop for each request, and /ready took a database connection for each."""

    def __init__(self, ask: Callable[[], Awaitable[T]], min_interval: float = PROBE_INTERVAL):
        self._ask = ask
        self.min_interval = min_interval
        self._last: tuple[T] | None = None
        self._asked_at = -math.inf
        self._asking: asyncio.Future[T] | None = None

    async def get(self) -> T:
        if self._asking is None:
            fresh = time.monotonic() - self._asked_at < self.min_interval
            if self._last is not None and fresh:
                return self._last[0]
            self._asking = asyncio.ensure_future(self._answer())
            self._asking.add_done_callback(_observed)
        return await asyncio.shield(self._asking)

    async def _answer(self) -> T:
        try:
            answer = await self._ask()
            self._last, self._asked_at = (answer,), time.monotonic()
            return answer
        finally:
            self._asking = None


def _observed(asked: asyncio.Future[Any]) -> None:
    """Its failure counts as seen even when every caller left before it ended."""
    if not asked.cancelled():
        asked.exception()


@dataclass(frozen=True)
class Probes:
    """What liveness and readiness look at."""

    engines: Coalesced[list[EngineStats | None]]
    """Each engine's stats in engine order, None for one that does not answer."""
    readiness: Coalesced[dict[str, bool]]
    children: Supervisor | None
    """The child processes `loramux serve` supervises; None in other setups."""


@dataclass(frozen=True)
class MetricSources:
    """Where /metrics reads the gauges it refreshes before rendering."""

    metrics: Metrics
    engines: Coalesced[dict[str, str | None]]
    """Each engine's metrics text by its label, None for one that does not answer."""
    cache: ResponseCache
    quotas: QuotaService
    usage: UsageRecorder
    token: str | None
    """LORAMUX_METRICS_TOKEN: a scrape needs `Bearer <token>`; checked before anything is
    rendered or asked of the engines."""


def health_router(gw: GatewayState) -> Router:
    """/health, /ready and /metrics, given what they look at, composed from the process's state
    (as the admin router composes its services)."""

    async def readiness() -> dict[str, bool]:
        checks = await _readiness(gw.sessions, gw.redis, gw.engine)
        # A gateway that started before its engine is ready once it knows the engine's
        # identity (gateway.served_identity): not while the engine is of another release.
        checks["engine"] = checks["engine"] and gw.identity.confirmed
        return checks

    engine_stats, ready_checks = Coalesced(lambda: gw.engine.stats()), Coalesced(readiness)

    def probes() -> Probes:  # the children are the state's when asked (serve sets them later)
        return Probes(engine_stats, ready_checks, gw.children)

    engines = Coalesced(lambda: gw.engine.metrics())
    token = gw.settings.server.metrics_token
    sources = MetricSources(gw.metrics, engines, gw.cache, gw.quotas, gw.usage, token)
    return Router(
        "/",
        route_handlers=[health, ready, metrics],
        dependencies={
            "probes": Provide(probes, sync_to_thread=False),
            "sources": Provide(lambda: sources, sync_to_thread=False, use_cache=True),
        },
    )


@get("/health", include_in_schema=False)
async def health(probes: NamedDependency[Probes]) -> Response[dict[str, Any]]:
    """Liveness: 200 while this process serves, or is bringing a child process back or waits
    for an engine (a degraded state); 503 once a child it supervises keeps failing, when only
    restarting the whole service can help. The body says what is down: `status` ok | degraded
    | failing; `engine` up (every engine answers) | degraded (some do) | down (none does);
    `engines`, each engine's up | down in engine order (its index in LORAMUX_ENGINE_URLS);
    `pid` (which worker answered); and under `loramux serve` the state of each child process
    (up, pid, restarts, why it last exited, failing)."""
    engines = ["down" if s is None else "up" for s in await probes.engines.get()]
    engine = (
        "up" if engines and "down" not in engines else "degraded" if "up" in engines else "down"
    )
    body: dict[str, Any] = {"engine": engine, "engines": engines, "pid": os.getpid()}
    failing = False
    down = engine != "up"
    if probes.children is not None:
        body["children"] = probes.children.report()
        failing = probes.children.failing
        down = down or not all(c["up"] for c in body["children"].values())
    body["status"] = "failing" if failing else "degraded" if down else "ok"
    return Response(body, status_code=503 if failing else 200)


@get("/ready", include_in_schema=False)
async def ready(probes: NamedDependency[Probes]) -> Response[dict[str, Any]]:
    """Ready to serve: the database, the engine and Redis each answer within READY_PROBE_SECONDS."""
    checks = await probes.readiness.get()
    ok = all(checks.values())
    return Response({"ready": ok, "checks": checks}, status_code=200 if ok else 503)


async def _readiness(
    sessions: async_sessionmaker[AsyncSession], redis: Redis, engine: EngineClient
) -> dict[str, bool]:
    """Whether the database, the engines and Redis answer, asked together."""

    async def database() -> bool:
        async with sessions() as session:
            await session.execute(text("SELECT 1"))
        return True

    async def redis_answers() -> bool:
        return bool(await redis.ping())

    probes = {"database": database(), "engine": engine.ready(), "redis": redis_answers()}
    answers = await asyncio.gather(*(_answered(p) for p in probes.values()))
    return dict(zip(probes, answers, strict=True))


async def _answered(probe: Awaitable[bool]) -> bool:
    """What `probe` says, or False when it fails or has not answered in READY_PROBE_SECONDS."""
    try:
        async with asyncio.timeout(READY_PROBE_SECONDS):
            return await probe
    except Exception:
        return False


@get("/metrics", include_in_schema=False)
async def metrics(
    sources: NamedDependency[MetricSources], request: Request[Any, Any, Any]
) -> Response[bytes]:
    """This process's series and every answering engine's (docs/metrics.md)."""
    if not scrape_allowed(request.headers.get("authorization"), sources.token):
        return Response(UNAUTHORIZED.encode(), status_code=401, media_type="text/plain")
    usage = sources.usage
    degradation = Degradation(
        sources.cache.errors,
        dict(sources.quotas.redis_down),
        len(usage),
        dict(usage.dropped),
        sources.cache.decision_counts(),
        sources.cache.stats.fenced,
    )
    body = sources.metrics.render(degradation, await sources.engines.get())
    return Response(body, media_type="text/plain; version=0.0.4")
