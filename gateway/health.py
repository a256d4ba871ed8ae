"""Liveness (/health), readiness (/ready) and Prometheus metrics.

Liveness asks "should this process be restarted?", readiness "should it get traffic?". While the
engine is down — dead and being restarted by serve, or, with LORAMUX_ENGINE_URLS, unreachable —
/ready answers 503 and /health 200 with `status: degraded`: a restart of the whole service would
only lengthen the outage. /health answers 503 when a supervised child keeps failing to stay up.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from litestar import Response, Router, get
from litestar.di import NamedDependency, Provide
from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.cache.response_cache import ResponseCache
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.metrics import Degradation, Metrics
from loramux.gateway.quotas import QuotaService
from loramux.gateway.state import GatewayState
from loramux.gateway.supervisor import Supervisor
from loramux.gateway.usage import UsageRecorder

ENGINE_METRICS_INTERVAL = 0.05
"""At most this often (seconds) a worker's /metrics asks the engines for theirs."""


@dataclass(frozen=True)
class Probes:
    """What liveness and readiness look at."""

    engine: EngineClient
    sessions: async_sessionmaker[AsyncSession]
    redis: Redis
    children: Supervisor | None
    """The child processes `loramux serve` supervises; None in other setups."""


class EngineMetricsFeed:
    """The engines' metrics for /metrics, fetched at most once per `min_interval` seconds:
    scrapes in between get the last fetch, and concurrent ones share the one under way. The
    route needs no credentials (as Prometheus expects), and each fetch makes every engine
    render its metrics on its event loop: a client scraping without pause loaded every engine
    it reached."""

    def __init__(self, engine: EngineClient, min_interval: float = ENGINE_METRICS_INTERVAL):
        self.engine = engine
        self.min_interval = min_interval
        self._last: list[str] = []
        self._fetched_at = -math.inf
        self._fetching: asyncio.Future[list[str]] | None = None

    async def get(self) -> list[str]:
        if self._fetching is None:
            if time.monotonic() - self._fetched_at < self.min_interval:
                return self._last
            self._fetching = asyncio.ensure_future(self._fetch())
        return await asyncio.shield(self._fetching)

    async def _fetch(self) -> list[str]:
        try:
            self._last = await self.engine.metrics()
            self._fetched_at = time.monotonic()
            return self._last
        finally:
            self._fetching = None


@dataclass(frozen=True)
class MetricSources:
    """Where /metrics reads the gauges it refreshes before rendering."""

    metrics: Metrics
    engine: EngineMetricsFeed
    cache: ResponseCache
    quotas: QuotaService
    usage: UsageRecorder


def health_router(gw: GatewayState) -> Router:
    """/health, /ready and /metrics, given what they look at, composed from the process's state
    (as the admin router composes its services)."""

    def probes() -> Probes:
        return Probes(gw.engine, gw.sessions, gw.redis, gw.children)

    feed = EngineMetricsFeed(gw.engine)
    sources = MetricSources(gw.metrics, feed, gw.cache, gw.quotas, gw.usage)
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
    """Liveness: 200 while this process serves, or is bringing a child process back (a degraded
    state that /ready reports as not ready); 503 once a child it supervises keeps failing, when
    only restarting the whole service can help. The body says what is down:
    `status` ok | degraded | failing, `engine` up | down, `pid` (which worker answered), and under `loramux serve` the state of
    each child process (up, pid, restarts, why it last exited, failing)."""
    engine_up = await probes.engine.ready()
    body: dict[str, Any] = {"engine": "up" if engine_up else "down", "pid": os.getpid()}
    failing = False
    down = not engine_up
    if probes.children is not None:
        body["children"] = probes.children.report()
        failing = probes.children.failing
        down = down or not all(c["up"] for c in body["children"].values())
    body["status"] = "failing" if failing else "degraded" if down else "ok"
    return Response(body, status_code=503 if failing else 200)


@get("/ready", include_in_schema=False)
async def ready(probes: NamedDependency[Probes]) -> Response[dict[str, Any]]:
    """Ready to serve: the database answers and the engine is running."""
    checks: dict[str, bool] = {}
    try:
        async with probes.sessions() as session:
            await session.execute(text("SELECT 1"))
        checks["database"] = True
    except Exception:
        checks["database"] = False
    checks["engine"] = await probes.engine.ready()
    try:
        checks["redis"] = bool(await probes.redis.ping())
    except Exception:
        checks["redis"] = False
    ok = all(checks.values())
    return Response({"ready": ok, "checks": checks}, status_code=200 if ok else 503)


@get("/metrics", include_in_schema=False)
async def metrics(sources: NamedDependency[MetricSources]) -> Response[bytes]:
    """This process's series and every answering engine's (docs/metrics.md)."""
    usage = sources.usage
    degradation = Degradation(
        sources.cache.errors,
        dict(sources.quotas.redis_down),
        len(usage),
        dict(usage.dropped),
        sources.cache.decision_counts(),
    )
    body = sources.metrics.render(degradation, await sources.engine.get())
    return Response(body, media_type="text/plain; version=0.0.4")
