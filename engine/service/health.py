"""The engine's one HTTP endpoint, for orchestrators and scrapers only (no requests):

GET /health    200 while the step loop runs; 503 once it stopped, or while one step has taken
               longer than async_engine.STALL_SECONDS (hung: serve's supervisor then restarts
               the engine). Gateways ask the same over the channel: its stats call is refused
               meanwhile (server), so they count the engine down.
GET /metrics   the engine's Prometheus metrics (engine.metrics), as gateways also get them;
               with a metrics token (LORAMUX_METRICS_TOKEN), only for `Bearer <token>` (401)
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Litestar, Request, Response, get
from litestar.di import NamedDependency, Provide

from loramux.engine.async_engine import AsyncEngine

Engine = NamedDependency[AsyncEngine]


@get("/health")
async def health(engine: Engine) -> Response[dict[str, str]]:
    state = engine.health
    return Response({"status": state}, status_code=200 if state == "ok" else 503)


@get("/metrics")
async def metrics(
    engine: Engine, request: Request[Any, Any, Any], metrics_token: NamedDependency[str | None]
) -> Response[str]:
    if not scrape_allowed(request.headers.get("authorization"), metrics_token):
        return Response(UNAUTHORIZED, status_code=401, media_type="text/plain")
    return Response(engine.engine.metrics.render(), media_type="text/plain; version=0.0.4")


UNAUTHORIZED = "this endpoint needs 'Authorization: Bearer <LORAMUX_METRICS_TOKEN>'\n"


def scrape_allowed(authorization: str | None, token: str | None) -> bool:
    """Whether a scrape may read metrics: always without a token, else with `Bearer <token>`
    (compared in constant time). Per-adapter series name digests, so an open endpoint tells
    anyone which adapters the engine holds."""
    if not token:
        return True
    expected = f"Bearer {token}".encode()
    return hmac.compare_digest((authorization or "").encode(), expected)


def create_health_app(engine: AsyncEngine, metrics_token: str | None = None) -> Litestar:
    async def provide() -> AsyncEngine:
        return engine

    return Litestar(
        route_handlers=[health, metrics],
        dependencies={
            "engine": Provide(provide),
            "metrics_token": Provide(lambda: metrics_token, sync_to_thread=False),
        },
        openapi_config=None,
        debug=False,
    )
