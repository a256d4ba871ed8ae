"""Liveness (/health), readiness (/ready) and Prometheus metrics.

Liveness asks "should this process be restarted?", readiness "should it get traffic?". While the
engine is down — dead and being restarted by serve, or, with LORAMUX_ENGINE_URLS, unreachable —
/ready answers 503 and /health 200 with `status: degraded`: a restart of the whole service would
only lengthen the outage. /health answers 503 when a supervised child keeps failing to stay up.
"""

from __future__ import annotations

import os
from typing import Any

from litestar import Response, get
from litestar.di import NamedDependency
from sqlalchemy import text

from gateway.state import GatewayState

GW = NamedDependency[GatewayState]


@get("/health", include_in_schema=False)
async def health(gw: GW) -> Response[dict[str, Any]]:
    """Liveness: 200 while this process serves, or is bringing a child process back (a degraded
    state that /ready reports as not ready); 503 once a child it supervises keeps failing, when
    only restarting the whole service can help. The body says what is down:
    `status` ok | degraded | failing, `engine` up | down, `pid` (which worker answered), and under `loramux serve` the state of
    each child process (up, pid, restarts, why it last exited, failing)."""
    engine_up = await gw.engine.ready()
    body: dict[str, Any] = {"engine": "up" if engine_up else "down", "pid": os.getpid()}
    failing = False
    down = not engine_up
    if gw.children is not None:
        body["children"] = gw.children.report()
        failing = gw.children.failing
        down = down or not all(c["up"] for c in body["children"].values())
    body["status"] = "failing" if failing else "degraded" if down else "ok"
    return Response(body, status_code=503 if failing else 200)


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
    gw.metrics.observe_cache_decisions(gw.cache.decision_counts())
    gw.metrics.observe_usage(len(gw.usage), gw.usage.dropped)
    for stats in (await gw.engine.stats())[:1]:
        gw.metrics.engine_running.set(stats.running)
        gw.metrics.engine_waiting.set(stats.waiting)
        gw.metrics.kv_used.set(stats.kv_blocks_used)
        gw.metrics.kv_total.set(stats.kv_blocks_total)
        gw.metrics.prefix_hits.set(stats.prefix_cache_hit_tokens)
    return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")
