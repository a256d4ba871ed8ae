"""Synthetic usage and the two usage measures run by `bench.quotas`.

- ingest: usage records go through `UsageRecorder` as the gateway uses it (started, `record` per
  request, its background task writing batches of events plus their hourly and daily rollups,
  then `close`) into a fresh SQLite file. The records look like live traffic: finished within
  the last minutes, many tenants, keys and models. Reference in the same run: the same batches
  inserted as events alone, without rollups. Also timed: `record` itself (the request path).
- dashboard: a fresh SQLite file holds `events` usage events over the last 30 days, with their
  rollups (generated in bulk: events inserted in chunks, rollups summed in Python and inserted
  once), one tenant holding `share` of them. A real gateway (uvicorn on loopback, the demo
  model in-process) serves `GET /dashboard` to that tenant's signed-in session: timed on the
  server (gathering the numbers and building the page, on the gateway's loop) and as a whole
  HTTP request; an admin's all-tenants page and `/admin/usage` likewise; and, when Chromium is
  installed, the browser's full page load (navigation to load event, stylesheet included).
  Reference: the same 30 days of totals summed from the raw events by SQL.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy import func, insert, select

from bench.common import CeilingFigure, Figure, percentile
from loramux.gateway.auth.api_keys import mint_key
from loramux.gateway.dashboard.pages import dashboard_page
from loramux.gateway.dashboard.session import Viewer
from loramux.gateway.dashboard.sources import DashboardSources
from loramux.gateway.dashboard.view import load_view, window_of
from loramux.gateway.db import ApiKey, Tenant, UsageEvent, UsageTotals, usage_daily, usage_hourly
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.db.usage_rollup import GROUP_KEY
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import EngineSettings, ServerSettings, Settings
from loramux.gateway.usage.recorder import (
    RollupKey,
    UsageRecord,
    UsageRecorder,
    daily_rollup,
    day_of,
    event_row,
    hourly_rollup,
)
from loramux.gateway.usage.recorder import usage_events as events_table

GOAL_INGEST_PER_S = 5000.0
GOAL_PAGE_MS = 500.0
"""Ours (the issue names none): a dashboard page, as one HTTP request, at p50."""
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
"""Headless Chromium on a machine without a display, GPU or network (Debian's `chromium`)."""
Measured = tuple[list[Figure], dict[str, Any], dict[str, Any]]


@dataclass(frozen=True)
class UsageWorkload:
    events: int
    tenants: int = 50
    keys: int = 3
    models: int = 6
    loads: int = 20
    """Page loads timed (dashboard only)."""
    share: float = 0.2
    """Of the events, those of the tenant whose page is timed (dashboard only)."""


INGEST_WORKLOADS = {
    "full": UsageWorkload(200_000),
    "quick": UsageWorkload(40_000),
    "smoke": UsageWorkload(2_000),
}
DASHBOARD_WORKLOADS = {
    "full": UsageWorkload(1_000_000, loads=30),
    "quick": UsageWorkload(200_000, loads=10),
    "smoke": UsageWorkload(5_000, loads=2),
}


def tenant_ids(w: UsageWorkload) -> list[str]:
    return [f"tnt_bench{i:04d}" for i in range(w.tenants)]


def synthetic(
    rng: random.Random, w: UsageWorkload, count: int, end: datetime, seconds: float
) -> Iterator[UsageRecord]:
    """`count` records finished within `seconds` before `end`; the first tenant has `share` of
    them, models are skewed (the first is the busiest)."""
    tenants = tenant_ids(w)
    weights = [1 / (m + 1) for m in range(w.models)]
    for i in range(count):
        latency = rng.lognormvariate(5.5, 0.8)
        cache = rng.choices(("miss", "exact", "semantic", "bypass"), (80, 12, 5, 3))[0]
        yield UsageRecord(
            request_id=f"req_{i}",
            tenant_id=tenants[0] if rng.random() < w.share else rng.choice(tenants[1:]),
            key_id=f"key{rng.randrange(w.keys)}",
            model=f"adapter-{rng.choices(range(w.models), weights)[0]}",
            adapter_digest=None,
            prompt_tokens=rng.randrange(20, 2000),
            completion_tokens=0 if cache != "miss" else rng.randrange(1, 500),
            cached_tokens=rng.randrange(0, 512),
            cache=cache,
            status=200 if rng.random() < 0.97 else rng.choice((400, 429, 499, 503)),
            latency_ms=latency,
            ttft_ms=latency * rng.uniform(0.05, 0.4),
            created_at=end - timedelta(seconds=rng.uniform(0, seconds)),
        )


# -- ingest -----------------------------------------------------------------------------------
async def _through_recorder(url: str, records: Sequence[UsageRecord]) -> float:
    db = create_engine(url)
    recorder = UsageRecorder(session_factory(db))
    recorder.start()
    start = time.perf_counter()
    for i, record in enumerate(records):
        recorder.record(record)
        if i % 200 == 199:  # requests finish over time: let the writer run
            await asyncio.sleep(0)
    await recorder.close()
    seconds = time.perf_counter() - start
    await db.dispose()
    return seconds


async def _events_only(url: str, records: Sequence[UsageRecord], batch: int = 2000) -> float:
    db = create_engine(url)
    sessions = session_factory(db)
    start = time.perf_counter()
    for i in range(0, len(records), batch):
        async with sessions() as session, session.begin():
            await session.execute(
                insert(events_table), [event_row(r) for r in records[i : i + batch]]
            )
    seconds = time.perf_counter() - start
    await db.dispose()
    return seconds


def _record_cost(records: Sequence[UsageRecord]) -> float:
    """Seconds per `record` call (appending to the buffer; nothing is written)."""
    recorder = UsageRecorder(session_factory(create_engine("sqlite://")))
    start = time.perf_counter()
    for record in records:
        recorder.record(record)
    return (time.perf_counter() - start) / len(records)


def measure_ingest(mode: str, workdir: Path) -> Measured:
    w = INGEST_WORKLOADS[mode]
    records = list(synthetic(random.Random(0), w, w.events, datetime.now(UTC), 600.0))
    urls = [f"sqlite:///{workdir / f'ingest-{arm}.db'}" for arm in ("recorder", "events")]
    for url in urls:
        upgrade(url)
    with_rollups = asyncio.run(_through_recorder(urls[0], records))
    events_only = asyncio.run(_events_only(urls[1], records))
    figures = [
        Figure(
            "ingest through UsageRecorder (events + rollups)",
            w.events / with_rollups,
            "events/s",
            goal_min=GOAL_INGEST_PER_S,
        ),
        Figure("reference: events alone, no rollups", w.events / events_only, "events/s"),
        Figure("record() on the request path", _record_cost(records) * 1e6, "µs"),
    ]
    details = {"rollup_cost_ratio": with_rollups / events_only, "batch": 2000, "window_s": 600}
    return figures, asdict(w), details


# -- dashboard --------------------------------------------------------------------------------
def fill_database(url: str, w: UsageWorkload, now: datetime) -> tuple[str, float]:
    """Tenants, one API key for the first tenant (returned), the events and their rollups."""
    start = time.perf_counter()
    engine = create_sync_engine(url)
    key = mint_key()
    hourly: dict[RollupKey, UsageTotals] = {}
    daily: dict[RollupKey, UsageTotals] = {}
    rng, chunk = random.Random(1), 100_000
    with engine.begin() as conn:
        tenants = tenant_ids(w)
        conn.execute(insert(Tenant), [{"id": t, "name": t.removeprefix("tnt_")} for t in tenants])
        conn.execute(
            insert(ApiKey),
            [{"id": key.id, "tenant_id": tenants[0], "secret_hash": key.secret_hash}],
        )
        for done in range(0, w.events, chunk):
            records = list(synthetic(rng, w, min(chunk, w.events - done), now, 30 * 86400.0))
            conn.execute(insert(events_table), [event_row(r) for r in records])
            chunk_hourly = hourly_rollup(records)
            for rows, chunk_rows in ((hourly, chunk_hourly), (daily, daily_rollup(chunk_hourly))):
                for k, totals in chunk_rows.items():
                    rows.setdefault(k, UsageTotals()).add(totals)
        for table, rows in ((usage_hourly, hourly), (usage_daily, daily)):
            params = [dict(zip(GROUP_KEY, k, strict=True)) | t.values() for k, t in rows.items()]
            conn.execute(insert(table), params)
    engine.dispose()
    return key.key, time.perf_counter() - start


def _ms(seconds: float) -> float:
    return seconds * 1000


def timed_gets(client: httpx.Client, path: str, params: dict[str, str], n: int) -> list[float]:
    """Milliseconds of each of `n` GETs on one keep-alive connection."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        response = client.get(path, params=params)
        times.append(_ms(time.perf_counter() - start))
        response.raise_for_status()
    return times


def sign_in(client: httpx.Client, credential: str) -> None:
    response = client.post("/dashboard/login", data={"credential": credential})
    if response.status_code != 303:
        raise RuntimeError(f"dashboard sign-in failed: {response.status_code} {response.text}")


def server_side(server: RunningServer, tenant: str, key_id: str, n: int) -> list[float]:
    """Milliseconds to gather the page's numbers and build its HTML, on the gateway's loop."""
    viewer = Viewer(key_id, tenant, int(time.time()) + 900, "bench")

    async def render() -> float:
        start = time.perf_counter()
        now = datetime.now(UTC)
        window = window_of(30, None, None, now)
        dashboard_page(
            await load_view(DashboardSources.of(server.state), tenant, window, now, viewer.subject),
            viewer,
        )
        return time.perf_counter() - start

    return [_ms(server.run(render())) for _ in range(n)]


def raw_scan(url: str, tenant: str, since: datetime) -> float:
    """Milliseconds to sum 30 days of one tenant's usage per day from the raw events (the
    median of three runs)."""
    engine = create_sync_engine(url)
    e = UsageEvent
    day = func.strftime("%Y-%m-%d", e.created_at)
    stmt = (
        select(
            day,
            func.count(),
            func.sum(e.prompt_tokens),
            func.sum(e.completion_tokens),
            func.sum(e.latency_ms),
        )
        .where(e.tenant_id == tenant, e.created_at >= since)
        .group_by(day)
    )
    times = []
    with engine.connect() as conn:
        for _ in range(3):
            start = time.perf_counter()
            conn.execute(stmt).all()
            times.append(time.perf_counter() - start)
    engine.dispose()
    return _ms(sorted(times)[1])


def browser_loads(url: str, key: str, n: int) -> list[float] | None:
    """Milliseconds from navigation start to the load event of `/dashboard` in headless
    Chromium, signed in with `key`; None when Chromium or Playwright is missing."""
    chromium = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if chromium is None:
        return None
    navigation = "() => performance.getEntriesByType('navigation')[0].loadEventEnd"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/dashboard")
        page.fill("[data-testid=credential]", key)
        page.click("[data-testid=sign-in]")
        page.wait_for_selector("[data-testid=total-requests]")
        times = []
        for _ in range(n):
            page.goto(f"{url}/dashboard", wait_until="load")
            times.append(float(page.evaluate(navigation)))
        browser.close()
    return times


def _gateway(url: str, workdir: Path, redis_url: str) -> Any:
    from loramux.engine.demo_model import build_demo_model

    model_dir = workdir / "demo-model"
    build_demo_model(model_dir, seed=0)
    settings = Settings(
        data_dir=workdir / "gateway",
        model=model_dir,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=32),
        server=ServerSettings(database_url=url, model_name="demo-model"),
    )
    return serve_in_thread(
        settings, engine_client(settings, model_dir), model_dir, redis_url=redis_url
    )


def p50_p99(label: str, ms: Sequence[float], goal: float | None = None) -> list[Figure]:
    return [
        CeilingFigure(f"{label} p50", percentile(ms, 50), "ms", goal_max=goal),
        Figure(f"{label} p99", percentile(ms, 99), "ms"),
    ]


def measure_dashboard(mode: str, workdir: Path, redis_url: str) -> Measured:
    w = DASHBOARD_WORKLOADS[mode]
    url = f"sqlite:///{workdir / 'dashboard.db'}"
    upgrade(url)
    now = datetime.now(UTC)
    key, fill_seconds = fill_database(url, w, now)
    tenant, key_id = tenant_ids(w)[0], key.split(".")[0].removeprefix("lmx-")
    with _gateway(url, workdir, redis_url) as server:
        admin = server.state.admin.mint("bench-dashboard", ttl_seconds=3600)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            sign_in(client, key)
            first = timed_gets(client, "/dashboard", {}, 1)[0]
            page = timed_gets(client, "/dashboard", {}, w.loads)
        with httpx.Client(base_url=server.url, timeout=120) as client:
            sign_in(client, admin)
            every = timed_gets(client, "/dashboard", {}, max(w.loads // 2, 1))
        headers = {"authorization": f"Bearer {admin}"}
        with httpx.Client(base_url=server.url, timeout=120, headers=headers) as client:
            usage_api = timed_gets(client, "/admin/usage", {"tenant": tenant}, w.loads)
        rendered = server_side(server, tenant, key_id, w.loads)
        browser = None if mode == "smoke" else browser_loads(server.url, key, min(w.loads, 10))
    raw = raw_scan(url, tenant, day_of(now) - timedelta(days=29))
    figures = [
        *p50_p99("dashboard page, tenant, HTTP", page, GOAL_PAGE_MS),
        *p50_p99("dashboard page, tenant, server side", rendered),
        *p50_p99("dashboard page, admin, all tenants, HTTP", every),
        *p50_p99("/admin/usage by day, tenant, HTTP", usage_api),
        Figure("dashboard page, tenant, HTTP, first load", first, "ms"),
        Figure("reference: 30 days of the tenant summed from raw events (SQL)", raw, "ms"),
    ]
    if browser:
        figures += p50_p99("dashboard page, tenant, Chromium load event", browser)
    details = {
        "events": w.events,
        "tenant_events": round(w.events * w.share),
        "fill_seconds": fill_seconds,
        "database_mb": (workdir / "dashboard.db").stat().st_size / 2**20,
        "browser": "headless Chromium" if browser else "not run (smoke, or no Chromium)",
    }
    return figures, asdict(w), details
