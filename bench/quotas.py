"""What quotas cost the gateway: a list of measures over one private Redis and one SQLite
database, each adding its figures and details to one result.

- limiter (`measure_limiter`): `QuotaService.admit` and `Admission.settle` as the gateway calls
  them, on one event loop with the gateway's kind of Redis client (`Redis.from_url`) to a private
  redis-server on a unix socket (what `loramux serve` starts when no LORAMUX_REDIS_URL is set).
  The principal has every limit at both scopes (tenant and key: requests and tokens per minute,
  concurrency, a monthly and a daily budget — six buckets, the most a request meets), set high
  enough that nothing is refused, so each call runs the whole check and reservation. Quota rows
  come from the in-process cache, as on the hot path.
  - one at a time: each admit, then its settle, timed alone (the cost per request);
  - under load: `in_flight` requests admitted and settled at once by a closed loop, each call
    timed from its start to its end (includes waiting for the event loop) — and admissions/s;
  - a principal with no limits: admission without Redis (the floor).

- ingest (`measure_ingest`): usage records through `UsageRecorder` into SQLite, events and
  their hourly and daily rollups; reference: the events alone (see `bench.usage_workload`).
- dashboard (`measure_dashboard`): `GET /dashboard` with 1,000,000 usage events stored (fewer
  in quick and smoke runs), on the server, over HTTP and in headless Chromium; reference: the
  same totals summed from the raw events.

Run: `python -m bench.quotas [--quick]`.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from bench import usage_workload
from bench.common import (
    CeilingFigure,
    Figure,
    Result,
    RunSettings,
    Stopwatch,
    configure,
    parse_args,
    percentile,
    report,
)
from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.db import ApiKey, Quota, Tenant
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.quotas import QuotaService
from loramux.gateway.redis_server import private_redis
from loramux.gateway.settings import QuotaSettings

NAME = "quotas"
GOAL_ADMIT_P50_MS = 1.0
HIGH = 10**12
"""A limit no benchmark run reaches."""


@dataclass(frozen=True)
class Rig:
    """What every measure gets: the run's settings, a private Redis, a migrated database."""

    settings: RunSettings
    redis_url: str
    database_url: str


@dataclass(frozen=True)
class Measured:
    figures: list[Figure]
    workload: dict[str, Any]
    details: dict[str, Any]


Measure = Callable[[Rig], Measured]


# -- limiter ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LimiterWorkload:
    sequential: int
    """Admit + settle pairs timed one at a time."""
    loaded: int
    """Admit + settle pairs run under load."""
    in_flight: int
    prompt_tokens: int = 200
    max_tokens: int = 300


LIMITER_WORKLOADS = {
    "full": LimiterWorkload(20_000, 20_000, 64),
    "quick": LimiterWorkload(3_000, 3_000, 64),
    "smoke": LimiterWorkload(50, 50, 8),
}

EVERY_LIMIT = {"rpm": HIGH, "tpm": HIGH, "max_concurrent": HIGH, "token_budget": HIGH}


async def make_principal(sessions: async_sessionmaker[AsyncSession], limited: bool) -> Principal:
    """A tenant and key; with every limit at both scopes when `limited`."""
    key_id = uuid.uuid4().hex[:12]
    async with sessions() as s:
        tenant = Tenant(name=f"bench-{uuid.uuid4().hex[:10]}")
        s.add(tenant)
        await s.flush()
        s.add(ApiKey(id=key_id, tenant_id=tenant.id, secret_hash="0" * 64))
        await s.flush()
        if limited:
            s.add(Quota(tenant_id=tenant.id, key_id=None, budget_period="month", **EVERY_LIMIT))
            s.add(Quota(tenant_id=tenant.id, key_id=key_id, budget_period="day", **EVERY_LIMIT))
        await s.commit()
    return Principal(tenant.id, tenant.name, key_id, None, {})


async def one_at_a_time(
    svc: QuotaService, p: Principal, w: LimiterWorkload, count: int
) -> tuple[list[float], list[float]]:
    """Seconds of each admit and of each settle."""
    admits: list[float] = []
    settles: list[float] = []
    for _ in range(count):
        start = time.perf_counter()
        admission = await svc.admit(p, w.prompt_tokens, w.max_tokens)
        admitted = time.perf_counter()
        await admission.settle(w.prompt_tokens + w.max_tokens // 2)
        admits.append(admitted - start)
        settles.append(time.perf_counter() - admitted)
    return admits, settles


async def under_load(
    svc: QuotaService, p: Principal, w: LimiterWorkload
) -> tuple[list[float], Stopwatch]:
    """Seconds of each admit with `in_flight` requests at once, and the wall and CPU time of
    all (this process's CPU: the gateway's side, without redis-server's)."""
    admits: list[float] = []
    pending = iter(range(w.loaded))

    async def worker() -> None:
        for _ in pending:
            start = time.perf_counter()
            admission = await svc.admit(p, w.prompt_tokens, w.max_tokens)
            admits.append(time.perf_counter() - start)
            await admission.settle(w.prompt_tokens + w.max_tokens // 2)

    with Stopwatch("cpu") as watch:
        await asyncio.gather(*(worker() for _ in range(w.in_flight)))
    return admits, watch


def latency(label: str, seconds: Sequence[float], goal_p50: float | None = None) -> list[Figure]:
    ms = [s * 1000 for s in seconds]
    return [
        CeilingFigure(f"{label} p50", percentile(ms, 50), "ms", goal_max=goal_p50),
        Figure(f"{label} p99", percentile(ms, 99), "ms"),
    ]


async def limiter(rig: Rig, w: LimiterWorkload) -> Measured:
    db = create_engine(rig.database_url)
    sessions = session_factory(db)
    redis = Redis.from_url(rig.redis_url)
    svc = QuotaService(redis, sessions, QuotaSettings(config_cache_seconds=3600.0))
    try:
        limited = await make_principal(sessions, limited=True)
        unlimited = await make_principal(sessions, limited=False)
        await one_at_a_time(svc, limited, w, max(10, w.sequential // 10))  # warm-up
        admits, settles = await one_at_a_time(svc, limited, w, w.sequential)
        floor, _ = await one_at_a_time(svc, unlimited, w, w.sequential)
        loaded, watch = await under_load(svc, limited, w)
    finally:
        await svc.close()
        await redis.aclose()
        await db.dispose()
    figures = [
        *latency("admit, every limit, one at a time", admits, GOAL_ADMIT_P50_MS),
        *latency("settle, one at a time", settles),
        *latency(f"admit, every limit, {w.in_flight} in flight", loaded),
        Figure(f"admit + settle, {w.in_flight} in flight", w.loaded / watch.seconds, "req/s"),
        Figure(
            "gateway CPU per admit + settle, under load",
            watch.cpu_seconds / w.loaded * 1000,
            "ms",
        ),
        *latency("admit, no limits (no Redis)", floor),
    ]
    details = {
        "redis": "private redis-server on a unix socket (as `loramux serve` starts it)",
        "buckets": "tenant and key: requests+tokens window, concurrency, budget (6 buckets)",
        "admit_mean_ms": sum(admits) / len(admits) * 1000,
        "settle_mean_ms": sum(settles) / len(settles) * 1000,
    }
    return Measured(figures, asdict(w), details)


def measure_limiter(rig: Rig) -> Measured:
    """The cost of the limiter check per request, as the gateway sees it (see the module doc)."""
    return asyncio.run(limiter(rig, LIMITER_WORKLOADS[rig.settings.mode]))


# -- usage metering and the dashboard (bench.usage_workload holds the details) ----------------
def measure_ingest(rig: Rig) -> Measured:
    """Usage ingest throughput through `UsageRecorder` (events and rollups) into SQLite."""
    with tempfile.TemporaryDirectory(prefix="loramux-bench-ingest-") as tmp:
        return Measured(*usage_workload.measure_ingest(rig.settings.mode, Path(tmp)))


def measure_dashboard(rig: Rig) -> Measured:
    """Dashboard page load time with many usage events stored (1,000,000 in full runs)."""
    with tempfile.TemporaryDirectory(prefix="loramux-bench-dashboard-") as tmp:
        return Measured(
            *usage_workload.measure_dashboard(rig.settings.mode, Path(tmp), rig.redis_url)
        )


MEASURES: list[Measure] = [measure_limiter, measure_ingest, measure_dashboard]
"""Run in this order; each names its workload and details after itself."""


# -- running ----------------------------------------------------------------------------------
def run_measures(
    rig: Rig, measures: Sequence[Measure]
) -> tuple[list[Figure], dict[str, Any], dict[str, Any]]:
    figures: list[Figure] = []
    workload: dict[str, Any] = {}
    details: dict[str, Any] = {}
    for measure in measures:
        name = measure.__name__.removeprefix("measure_")
        measured = measure(rig)
        figures += measured.figures
        workload[name] = measured.workload
        details[name] = measured.details
    return figures, workload, details


def main(argv: Sequence[str] | None = None) -> Path:
    settings = parse_args(__doc__ or NAME, argv)
    configure(settings)
    with (
        tempfile.TemporaryDirectory(prefix="loramux-bench-") as tmp,
        private_redis(Path(tmp)) as redis_url,
    ):
        database_url = f"sqlite:///{Path(tmp) / 'loramux.db'}"
        upgrade(database_url)
        rig = Rig(settings, redis_url, database_url)
        figures, workload, details = run_measures(rig, MEASURES)
    model = {"name": "none: the quota measures run no model"}
    return report(Result(NAME, settings, model, workload, {}, figures, details))


if __name__ == "__main__":
    main()
