"""Usage metering: every recorded event is stored, the hourly and daily rollups always equal the
sums of the stored events, and usage read from rollups over any range equals summing the events
(SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable, Hashable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from alembic import command
from sqlalchemy import DateTime, Table, column, insert, select, table
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db import Quota, Tenant, UsageEvent, UsageTotals, usage_daily, usage_hourly
from loramux.gateway.db.migrate import alembic_config, upgrade, with_connection
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.db.usage_rollup import BINS, BOUNDS_MS, GROUP_KEY, MEASURES, percentile
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import EngineSettings, ServerSettings, Settings
from loramux.gateway.usage.query import Dimension, Span, read_usage, spans
from loramux.gateway.usage.recorder import UsageRecord, UsageRecorder, as_utc
from tests.gateway.conftest import json_of
from tests.gateway.tenants import new_tenant

T0 = datetime(2030, 1, 1, tzinfo=UTC)
Sessions = async_sessionmaker[AsyncSession]


def random_events(rng: random.Random, n: int, tenants: Sequence[str]) -> list[UsageRecord]:
    """Events over three UTC days with every kind of outcome; some latencies sit on bin edges."""
    events = []
    for i in range(n):
        latency = rng.choice(BOUNDS_MS) if i % 10 == 0 else rng.lognormvariate(5, 1.5)
        ttft = None if rng.random() < 0.3 else latency * rng.random()
        events.append(
            UsageRecord(
                request_id=f"req_{i}",
                tenant_id=rng.choice(tenants),
                key_id=rng.choice(["key-a", "key-b"]),
                model=rng.choice(["demo-model", "support", "sql"]),
                adapter_digest=None,
                prompt_tokens=rng.randrange(0, 500),
                completion_tokens=rng.randrange(0, 200),
                cached_tokens=rng.randrange(0, 50),
                cache=rng.choice(["miss", "miss", "exact", "semantic", "bypass"]),
                status=rng.choice([200, 200, 200, 400, 429, 499, 503]),
                latency_ms=latency,
                ttft_ms=ttft,
                created_at=T0 + timedelta(seconds=rng.uniform(0, 3 * 86400)),
                refusal=rng.choice(
                    [None, "requests", "tokens", "concurrency", "budget", "backlog"]
                ),
            )
        )
    return events


def bins_of(values: Sequence[float]) -> list[int]:
    counts = [0] * BINS
    for v in values:
        counts[sum(bound < v for bound in BOUNDS_MS)] += 1
    return counts


def expected(events: Sequence[UsageRecord]) -> UsageTotals:
    """The truth, summed directly from the events."""
    ttfts = [e.ttft_ms for e in events if e.ttft_ms is not None]
    return UsageTotals(
        requests=len(events),
        errors=sum(e.status >= 400 for e in events),
        aborts=sum(e.status == 499 for e in events),
        refused_requests=sum(e.status == 429 and e.refusal in (None, "requests") for e in events),
        refused_tokens=sum(e.status == 429 and e.refusal == "tokens" for e in events),
        refused_concurrency=sum(e.status == 429 and e.refusal == "concurrency" for e in events),
        refused_budget=sum(e.status == 429 and e.refusal == "budget" for e in events),
        refused_backlog=sum(e.status == 429 and e.refusal == "backlog" for e in events),
        client_errors=sum(400 <= e.status < 500 and e.status not in (429, 499) for e in events),
        server_errors=sum(e.status >= 500 for e in events),
        prompt_tokens=sum(e.prompt_tokens for e in events),
        completion_tokens=sum(e.completion_tokens for e in events),
        cached_tokens=sum(e.cached_tokens for e in events),
        exact_hits=sum(e.cache == "exact" for e in events),
        semantic_hits=sum(e.cache == "semantic" for e in events),
        ttft_count=len(ttfts),
        latency_ms_sum=sum(e.latency_ms for e in events),
        ttft_ms_sum=sum(ttfts),
        latency_bins=bins_of([e.latency_ms for e in events]),
        ttft_bins=bins_of(ttfts),
    )


def expected_groups(
    events: Sequence[UsageRecord], key: Callable[[UsageRecord], Hashable]
) -> dict[Hashable, UsageTotals]:
    groups: dict[Hashable, list[UsageRecord]] = {}
    for e in events:
        groups.setdefault(key(e), []).append(e)
    return {k: expected(v) for k, v in groups.items()}


def assert_same(actual: dict[Hashable, UsageTotals], truth: dict[Hashable, UsageTotals]) -> None:
    assert actual.keys() == truth.keys()
    for k, totals in actual.items():
        assert totals.values() == pytest.approx(truth[k].values(), rel=1e-9), k


def label(e: UsageRecord, dimension: Dimension) -> str:
    ts = e.created_at.astimezone(UTC)
    return {
        "tenant": e.tenant_id,
        "key": e.key_id,
        "model": e.model,
        "day": ts.strftime("%Y-%m-%d"),
        "hour": ts.strftime("%Y-%m-%dT%H:00"),
    }[dimension]


async def stored_events(sessions: Sessions) -> list[UsageRecord]:
    async with sessions() as session:
        rows = (await session.scalars(select(UsageEvent))).all()
    fields = [f for f in UsageRecord.__dataclass_fields__ if f != "created_at"]
    return [
        UsageRecord(**{f: getattr(r, f) for f in fields}, created_at=as_utc(r.created_at))
        for r in rows
    ]


async def rollup_rows(sessions: Sessions, table: Table) -> dict[Hashable, UsageTotals]:
    async with sessions() as session:
        rows = (await session.execute(select(*(table.c[c] for c in GROUP_KEY + MEASURES)))).all()
    return {(r[0], as_utc(r[1]), r[2], r[3]): UsageTotals.from_values(r[4:]) for r in rows}


def bucket_key(unit: str) -> Callable[[UsageRecord], Hashable]:
    def key(e: UsageRecord) -> Hashable:
        ts = e.created_at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
        return (e.tenant_id, ts if unit == "hour" else ts.replace(hour=0), e.key_id, e.model)

    return key


async def assert_rollups_match_events(sessions: Sessions) -> list[UsageRecord]:
    events = await stored_events(sessions)
    assert_same(
        await rollup_rows(sessions, usage_hourly), expected_groups(events, bucket_key("hour"))
    )
    assert_same(
        await rollup_rows(sessions, usage_daily), expected_groups(events, bucket_key("day"))
    )
    return events


async def test_rollups_equal_the_sums_of_the_stored_events(sessions: Sessions) -> None:
    events = random_events(random.Random(1), 3000, ["t1", "t2", "t3"])
    recorder = UsageRecorder(sessions, batch=400)  # several batches update the same rows
    for e in events:
        recorder.record(e)
    assert await recorder.flush() == 3000
    stored = await assert_rollups_match_events(sessions)
    assert sorted(e.request_id for e in stored) == sorted(e.request_id for e in events)


async def test_two_gateways_writing_the_same_hours_at_once_add_up(
    sessions: Sessions, empty_url: str
) -> None:
    other_engine = create_engine(empty_url)
    recorders = [UsageRecorder(sessions, batch=100), UsageRecorder(session_factory(other_engine))]
    rng = random.Random(2)
    for recorder in recorders:
        for e in random_events(rng, 600, ["t1"]):
            recorder.record(e)
    assert await asyncio.gather(*(r.flush() for r in recorders)) == [600, 600]
    await other_engine.dispose()
    assert len(await assert_rollups_match_events(sessions)) == 1200


async def test_close_writes_the_events_recorded_just_before_it(sessions: Sessions) -> None:
    recorder = UsageRecorder(sessions, interval=3600)
    recorder.start()
    for e in random_events(random.Random(3), 500, ["t1"]):
        recorder.record(e)
    await recorder.close()
    assert len(await assert_rollups_match_events(sessions)) == 500


RANGES = [
    (None, None),
    (T0, T0 + timedelta(days=2)),
    (T0 + timedelta(hours=5, minutes=17, seconds=23.5), T0 + timedelta(days=2, hours=13.75)),
    (T0 + timedelta(days=1, hours=10, minutes=5), T0 + timedelta(days=1, hours=10, minutes=55)),
    (T0 + timedelta(days=1, hours=10), None),
    (None, T0 + timedelta(days=1, hours=7.5)),
]
GROUPINGS: list[tuple[Dimension, ...]] = [(), ("day",), ("tenant", "model"), ("key",), ("hour",)]


async def test_usage_over_any_range_equals_summing_its_events(sessions: Sessions) -> None:
    recorder = UsageRecorder(sessions)
    for e in random_events(random.Random(4), 2000, ["t1", "t2"]):
        recorder.record(e)
    await recorder.flush()
    events = await stored_events(sessions)
    for (start, end), by, tenant in (
        (r, by, tenant) for r in RANGES for by in GROUPINGS for tenant in (None, "t1")
    ):
        chosen = [
            e
            for e in events
            if (tenant is None or e.tenant_id == tenant)
            and (start is None or e.created_at >= start)
            and (end is None or e.created_at < end)
        ]
        actual = await read_usage(sessions, tenant=tenant, start=start, end=end, by=by)
        truth = expected_groups(chosen, lambda e, by=by: tuple(label(e, d) for d in by))
        assert_same(dict(actual), truth)


def test_a_range_is_read_from_whole_days_whole_hours_and_the_events_left_over() -> None:
    start, end = T0 + timedelta(hours=22, minutes=30), T0 + timedelta(days=3, hours=2, seconds=1)
    assert spans(start, end) == [
        Span("event", start, T0 + timedelta(hours=23)),
        Span("hour", T0 + timedelta(hours=23), T0 + timedelta(days=1)),
        Span("day", T0 + timedelta(days=1), T0 + timedelta(days=3)),
        Span("hour", T0 + timedelta(days=3), T0 + timedelta(days=3, hours=2)),
        Span("event", T0 + timedelta(days=3, hours=2), end),
    ]
    assert spans(None, None) == [Span("day", None, None)]
    assert spans(T0, None, ["hour"]) == [Span("hour", T0, None)]
    inside_one_hour = (T0 + timedelta(minutes=1), T0 + timedelta(minutes=2))
    assert spans(*inside_one_hour) == [Span("event", *inside_one_hour)]


def test_percentiles_read_from_the_histogram_fall_in_the_true_percentiles_bin() -> None:
    rng = random.Random(5)
    values = sorted(rng.lognormvariate(5, 1.5) for _ in range(10_000))
    bins = bins_of(values)
    edges = [0.0, *BOUNDS_MS, float("inf")]
    for q in (0.5, 0.9, 0.99):
        true = values[int(q * len(values)) - 1]
        b = sum(bound < true for bound in BOUNDS_MS)
        estimate = percentile(bins, q)
        assert estimate is not None and edges[b] <= estimate <= edges[b + 1]
    assert percentile([0] * BINS, 0.5) is None


def test_upgrading_a_database_with_events_fills_the_rollups(empty_url: str) -> None:
    command.upgrade(alembic_config(empty_url), "161bc3649f82")  # before rollups existed
    events = random_events(random.Random(6), 1500, ["t1", "t2"])
    # That schema predates `admitted_at`, `refusal` and `event_id` too.
    newer = ("admitted_at", "refusal", "event_id")
    rows = [{k: v for k, v in vars(e).items() if k not in newer} for e in events]

    names = [n for n in rows[0] if n != "created_at"]
    old_events = table(
        "usage_events", column("created_at", DateTime(timezone=True)), *map(column, names)
    )

    def insert_events(connection: object) -> None:
        connection.execute(insert(old_events), rows)  # type: ignore[attr-defined]
        connection.commit()  # type: ignore[attr-defined]

    with_connection(empty_url, insert_events)
    upgrade(empty_url)

    async def check() -> None:
        engine = create_engine(empty_url)
        await assert_rollups_match_events(session_factory(engine))
        await engine.dispose()

    asyncio.run(check())


async def test_a_tenant_has_at_most_one_tenant_level_quota_row(sessions: Sessions) -> None:
    async with sessions() as session:
        session.add(Tenant(id="tnt_quota", name="quota"))
        await session.flush()
        session.add(Quota(tenant_id="tnt_quota", rpm=1))
        await session.commit()
    async with sessions() as session:
        session.add(Quota(tenant_id="tnt_quota", rpm=2))
        with pytest.raises(IntegrityError):
            await session.commit()


def usage_report(admin: httpx.Client, **params: str) -> dict[str, dict[str, object]]:
    response = admin.get("/admin/usage", params=params)
    assert response.status_code == 200, response.text
    return {str(r["group"]): r for r in json_of(response)["rows"]}


def test_the_usage_api_equals_the_recorded_events(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenants = [f"tnt_rollup{uuid.uuid4().hex[:8]}" for _ in range(2)]
    events = random_events(random.Random(7), 2000, tenants)

    async def record() -> None:
        for e in events:
            gateway.state.usage.record(e)
        await gateway.state.usage.flush()

    gateway.run(record())
    start, end = T0 + timedelta(hours=5, minutes=17, seconds=23.5), T0 + timedelta(days=2, hours=1)
    for (low, high), group_by in (
        (r, g) for r in [(None, None), (start, end)] for g in ("day", "adapter", "key")
    ):
        bounds = {"from": low.isoformat(), "to": high.isoformat()} if low and high else {}
        report = usage_report(admin, tenant=tenants[0], group_by=group_by, **bounds)
        chosen = [
            e
            for e in events
            if e.tenant_id == tenants[0] and (low is None or low <= e.created_at < high)
        ]
        dimension: Dimension = {"day": "day", "adapter": "model", "key": "key"}[group_by]
        truth = expected_groups(chosen, lambda e, d=dimension: label(e, d))
        assert report.keys() == truth.keys()
        for group, row in report.items():
            t = truth[group]
            assert (row["requests"], row["errors"], row["cache_hits"]) == (
                t.requests,
                t.errors,
                t.cache_hits,
            )
            assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (
                t.prompt_tokens,
                t.completion_tokens,
                t.cached_tokens,
            )
            assert row["mean_latency_ms"] == pytest.approx(t.mean_latency_ms)


def test_requests_answered_just_before_shutdown_are_all_stored(
    demo_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    """A gateway whose recorder has not written yet is shut down right after answering: the
    shutdown writes every event, with its rollups."""
    settings = Settings(
        data_dir=tmp_path,
        model=demo_model_dir,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=32),
        # the recorder writes only when the gateway shuts down
        server=ServerSettings(model_name="demo-model", usage_flush_seconds=3600.0),
    )
    upgrade(settings.database_url)
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    client = engine_client(settings, demo_model_dir)
    with serve_in_thread(settings, client, demo_model_dir, redis_url=redis_url) as server:
        token = server.state.admin.mint("test-admin", ttl_seconds=600)
        headers = {"authorization": f"Bearer {token}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as admin:
            tenant = new_tenant(admin, "shutdown")
            for _ in range(5):
                r = admin.post("/v1/chat/completions", json=body, headers=bearer(tenant.key))
                assert r.status_code == 200, r.text
            assert usage_report(admin, tenant=tenant.tenant_id) == {}  # nothing written yet

    async def check() -> None:
        engine = create_engine(settings.database_url)
        events = await assert_rollups_match_events(session_factory(engine))
        assert [e.tenant_id for e in events] == [tenant.tenant_id] * 5
        await engine.dispose()

    asyncio.run(check())


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}
