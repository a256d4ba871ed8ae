"""What clients that leave cost everyone else: the reliability suite's soak through a real gateway,
with 5% of requests disconnecting mid-stream, against the same soak with none, side by side.

The gateway runs as `loramux serve` composes it (uvicorn on loopback, SQLite, a private
redis-server, the in-process engine) with tenants, quotas and adapters made through the admin
API. Both arms send the same seeded requests (tests.reliability.traffic: streamed and whole, base
model, own and shared adapters; sampled, so the response cache never answers) from the same
number of closed-loop clients; in one arm the clients of 5% of the streams close the socket
after a few chunks, in the other they read to the end. Windows alternate which arm goes first,
to cancel drift. Throughput is requests per second (a request ends when its client has read it
or left); latency is over the requests read to their end. Disconnects should cost nothing:
throughput with them should be at least 0.95 of throughput without.

Run: `python -m bench.soak [--quick]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    Figure,
    Result,
    RunSettings,
    load_details,
    percentile,
    prepared_run,
    report,
)
from loramux.adapters.demo import build_demo_adapters
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.redis_server import private_redis
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import EngineSettings, ServerSettings, Settings
from tests.reliability import books
from tests.reliability.rig import admin_client, make_tenants
from tests.reliability.traffic import Mix, Outcome, Plan, Tenant, plan_requests, run_load

NAME = "soak"
GOAL_RATIO = 0.95
DISCONNECTING = 0.05


@dataclass(frozen=True)
class Workload:
    requests_per_window: int
    """Requests each arm sends per window (the same ones in both arms)."""
    windows: int
    concurrency: int
    tenants: int = 3
    disconnecting: float = DISCONNECTING
    max_tokens: tuple[int, int] = (8, 32)
    seed: int = 0

    def mix(self) -> Mix:
        top = self.max_tokens[1]
        return Mix(
            deterministic=0.0,
            disconnect=self.disconnecting,
            cancel=0.0,
            bad=0.0,
            max_tokens=self.max_tokens,
            cut_max_tokens=top,
        )


WORKLOADS = {
    "full": Workload(300, 4, 16),
    "quick": Workload(100, 2, 16),
    "smoke": Workload(12, 1, 4, max_tokens=(2, 6)),
}


@dataclass
class Arm:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    window_rps: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return len(self.outcomes) / self.seconds

    @property
    def read_whole(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.plan.ending == "complete"]

    def latency_ms(self, q: float) -> float:
        return percentile([o.latency for o in self.read_whole], q) * 1000


def staying(plans: list[Plan]) -> list[Plan]:
    """The same requests with every client reading to the end."""
    return [dataclasses.replace(p, ending="complete") for p in plans]


@contextlib.contextmanager
def running_gateway(
    settings: RunSettings, model_dir: Path, workdir: Path
) -> Iterator[tuple[RunningServer, str]]:
    """A gateway on loopback and the URL of its private Redis."""
    gateway_settings = Settings(
        data_dir=workdir / "gateway",
        model=model_dir,
        engine=EngineSettings(
            dtype=settings.dtype, device=settings.device, max_model_len=512, kv_cache_mb=64
        ),
        server=ServerSettings(model_name="demo-model"),
    )
    upgrade(gateway_settings.database_url)
    client = engine_client(gateway_settings, model_dir)
    with (
        private_redis(gateway_settings.data_dir) as redis_url,
        serve_in_thread(gateway_settings, client, model_dir, redis_url=redis_url) as server,
    ):
        yield server, redis_url


def run_arms(server: RunningServer, tenants: list[Tenant], workload: Workload) -> tuple[Arm, Arm]:
    """(no disconnects, disconnecting), window by window, alternating which goes first."""
    none, leaving = Arm(), Arm()
    for window in range(workload.windows):
        plans = list(
            plan_requests(
                workload.requests_per_window,
                len(tenants),
                workload.mix(),
                workload.seed * 1000 + window,
            )
        )
        order = [(none, staying(plans)), (leaving, plans)]
        for arm, arm_plans in order if window % 2 == 0 else order[::-1]:
            run = asyncio.run(run_load(server.url, tenants, arm_plans, workload.concurrency))
            arm.outcomes += run.outcomes
            arm.seconds += run.seconds
            arm.window_rps.append(len(run.outcomes) / run.seconds)
    return none, leaving


def arm_details(arm: Arm) -> dict[str, Any]:
    return {
        "requests": len(arm.outcomes),
        "seconds": arm.seconds,
        "requests_per_second_by_window": arm.window_rps,
        "disconnected": sum(o.plan.ending == "disconnect" for o in arm.outcomes),
        "server_errors": books.server_errors(arm.outcomes),
        "unfinished": books.unfinished(arm.outcomes),
        "completion_tokens_received": sum(
            (o.usage or {}).get("completion_tokens", 0) for o in arm.outcomes
        ),
        "latency_ms": {f"p{q}": arm.latency_ms(q) for q in (50, 90, 99)},
    }


def measure(
    server: RunningServer, redis_url: str, tenants: list[Tenant], workload: Workload
) -> tuple[list[Figure], dict[str, Any]]:
    load_start = os.getloadavg()
    none, leaving = run_arms(server, tenants, workload)
    load_end = os.getloadavg()
    residue = asyncio.run(books.settled_residue(server, redis_url, tenants))
    share = f"{workload.disconnecting:.0%} disconnecting"
    figures = [
        Figure("throughput, no disconnects", none.rps, "req/s"),
        Figure(f"throughput, {share}", leaving.rps, "req/s"),
        Figure(f"throughput ratio, {share} / none", leaving.rps / none.rps, "x", GOAL_RATIO),
        Figure("latency p50, no disconnects", none.latency_ms(50), "ms"),
        Figure(f"latency p50, {share}", leaving.latency_ms(50), "ms"),
        Figure("latency p99, no disconnects", none.latency_ms(99), "ms"),
        Figure(f"latency p99, {share}", leaving.latency_ms(99), "ms"),
    ]
    details = {
        "no_disconnects": arm_details(none),
        "disconnecting": arm_details(leaving),
        "residue_after": asdict(residue),
        "load_average": load_details(load_start, load_end),
    }
    return figures, details


def main(argv: Sequence[str] | None = None) -> Path:
    with prepared_run(__doc__ or NAME, argv) as run:
        settings, model_dir, workload = run.settings, run.model_dir, WORKLOADS[run.settings.mode]
        adapters = build_demo_adapters(model_dir, run.workdir / "adapters", workload.tenants + 1)
        with running_gateway(settings, model_dir, run.workdir) as (server, redis_url):
            with admin_client(server) as admin:
                tenants = make_tenants(admin, workload.tenants, adapters)
            figures, details = measure(server, redis_url, tenants, workload)
    engine = {"max_model_len": 512, "kv_cache_mb": 64, "dtype": settings.dtype}
    return report(Result(NAME, settings, run.model, asdict(workload), engine, figures, details))


if __name__ == "__main__":
    main()
