"""The engine's one HTTP endpoint, for orchestrators and scrapers only (no token, no requests):

GET /health    200 while the step loop runs, 503 otherwise
GET /metrics   the engine's Prometheus metrics (engine.metrics), as gateways also get them
"""

from __future__ import annotations

from litestar import Litestar, Response, get
from litestar.di import NamedDependency, Provide

from loramux.engine.async_engine import AsyncEngine

Engine = NamedDependency[AsyncEngine]


@get("/health")
async def health(engine: Engine) -> Response[dict[str, str]]:
    ok = engine.running
    return Response({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)


@get("/metrics")
async def metrics(engine: Engine) -> Response[str]:
    return Response(engine.engine.metrics.render(), media_type="text/plain; version=0.0.4")


def create_health_app(engine: AsyncEngine) -> Litestar:
    async def provide() -> AsyncEngine:
        return engine

    return Litestar(
        route_handlers=[health, metrics],
        dependencies={"engine": Provide(provide)},
        openapi_config=None,
        debug=False,
    )
