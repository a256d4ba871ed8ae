"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency
from sqlalchemy import text

from gateway.state import GatewayState

GW = NamedDependency[GatewayState]


@get("/health", include_in_schema=False, sync_to_thread=False)
def health() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@get("/ready", include_in_schema=False)
async def ready(gw: GW) -> Response[dict[str, Any]]:
    """Ready to serve: the database answers and the engine is running."""
    checks: dict[str, bool] = {}
    try:
        async with gw.sessions() as session:
            await session.execute(text("SELECT 1"))
        checks["database"] = True
    except Exception:
        checks["database"] = False
    checks["engine"] = await gw.engine.ready()
    try:
        checks["redis"] = bool(await gw.redis.ping())
    except Exception:
        checks["redis"] = False
    ok = all(checks.values())
    return Response({"ready": ok, "checks": checks}, status_code=200 if ok else 503)


@get("/metrics", include_in_schema=False)
async def metrics(gw: GW) -> Response[bytes]:
    gw.metrics.observe_degradation(gw.cache.errors, gw.quotas.redis_down)
    gw.metrics.observe_usage(len(gw.usage), gw.usage.dropped)
    for stats in (await gw.engine.stats())[:1]:
        gw.metrics.engine_running.set(stats.running)
        gw.metrics.engine_waiting.set(stats.waiting)
        gw.metrics.kv_used.set(stats.kv_blocks_used)
        gw.metrics.kv_total.set(stats.kv_blocks_total)
        gw.metrics.prefix_hits.set(stats.prefix_cache_hit_tokens)
    return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")
