"""The engine's one HTTP endpoint, for orchestrators and scrapers only (no token, no requests):

GET /health    200 while the step loop runs, 503 otherwise
GET /metrics   the engine's stats as Prometheus gauges and counters, and the pinned adapter slots
"""

from __future__ import annotations

from dataclasses import asdict

from litestar import Litestar, Response, get
from litestar.di import NamedDependency, Provide

from engine.async_engine import AsyncEngine

Engine = NamedDependency[AsyncEngine]

GAUGES = frozenset({"running", "waiting", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free"})
"""Stats that go up and down; every other stat counts since start."""


@get("/health")
async def health(engine: Engine) -> Response[dict[str, str]]:
    ok = engine.running
    return Response({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)


@get("/metrics")
async def metrics(engine: Engine) -> Response[str]:
    lines = []
    for name, value in asdict(engine.stats()).items():
        kind = "gauge" if name in GAUGES else "counter"
        metric = f"loramux_engine_{name}" + ("" if kind == "gauge" else "_total")
        lines += [f"# TYPE {metric} {kind}", f"{metric} {value}"]
    lines += ["# TYPE loramux_engine_adapter_slots_pinned gauge"]
    lines += [f"loramux_engine_adapter_slots_pinned {pinned_adapter_slots(engine)}"]
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def pinned_adapter_slots(engine: AsyncEngine) -> int:
    """Pins held on the device's adapter slots: one per running request on an adapter, so zero
    whenever the engine is idle (read off the step thread: a snapshot, for scrapers)."""
    lora = engine.engine.lora
    return 0 if lora is None else sum(slot.pins for slot in lora.slots)


def create_health_app(engine: AsyncEngine) -> Litestar:
    async def provide() -> AsyncEngine:
        return engine

    return Litestar(
        route_handlers=[health, metrics],
        dependencies={"engine": Provide(provide)},
        openapi_config=None,
        debug=False,
    )
