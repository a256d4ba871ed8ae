"""Usage metering: append-only events, written to SQL in batches off the request path, with their
hourly and daily rollups.

`record` only appends to an in-memory buffer; a background task flushes the buffer every
`interval` seconds (or sooner when it fills). One flush of a chunk is one transaction: it inserts
the events and adds them into `usage_hourly` and `usage_daily` (aggregated here first, then one
INSERT … ON CONFLICT DO UPDATE per table), so the rollups always equal the sums of the stored
events. `close` drains everything, so a clean shutdown loses nothing; a failed write keeps the
chunk for the next try. Usage never passes through Redis, so a Redis restart cannot lose any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Table, insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import Base, UsageEvent, UsageTotals, usage_daily, usage_hourly
from gateway.db.base import utcnow
from gateway.db.usage_rollup import GROUP_KEY, MEASURES, histogram_bin

usage_events = Base.metadata.tables[UsageEvent.__tablename__]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UsageRecord:
    """One finished request. `created_at` is when it finished; `status` 400 or more is an error;
    `cache` is `exact` or `semantic` when the response cache answered, else `miss` or `bypass`."""

    request_id: str
    tenant_id: str
    key_id: str
    model: str
    adapter_digest: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache: str
    status: int
    latency_ms: float
    ttft_ms: float | None
    created_at: datetime = field(default_factory=utcnow)


def hour_of(ts: datetime) -> datetime:
    """The UTC start of the hour of `ts` (a naive time is taken as UTC)."""
    return as_utc(ts).replace(minute=0, second=0, microsecond=0)


def day_of(ts: datetime) -> datetime:
    """The UTC start of the day of `ts`."""
    return hour_of(ts).replace(hour=0)


def as_utc(ts: datetime) -> datetime:
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


RollupKey = tuple[str, datetime, str, str]
"""`GROUP_KEY` values: tenant, bucket, key, model."""


def hourly_rollup(events: Iterable[UsageRecord]) -> dict[RollupKey, UsageTotals]:
    """The events summed per hourly rollup row."""
    rows: dict[RollupKey, UsageTotals] = {}
    for e in events:
        key = (e.tenant_id, hour_of(e.created_at), e.key_id, e.model)
        row = rows.get(key)
        if row is None:
            row = rows[key] = UsageTotals()
        row.requests += 1
        row.errors += int(e.status >= 400)
        row.prompt_tokens += e.prompt_tokens
        row.completion_tokens += e.completion_tokens
        row.cached_tokens += e.cached_tokens
        row.exact_hits += int(e.cache == "exact")
        row.semantic_hits += int(e.cache == "semantic")
        row.latency_ms_sum += e.latency_ms
        row.latency_bins[histogram_bin(e.latency_ms)] += 1
        if e.ttft_ms is not None:
            row.ttft_count += 1
            row.ttft_ms_sum += e.ttft_ms
            row.ttft_bins[histogram_bin(e.ttft_ms)] += 1
    return rows


def daily_rollup(hourly: dict[RollupKey, UsageTotals]) -> dict[RollupKey, UsageTotals]:
    """Hourly rollup rows summed per day (far fewer than the events they came from)."""
    rows: dict[RollupKey, UsageTotals] = {}
    for (tenant, hour, key, model), totals in hourly.items():
        rows.setdefault((tenant, hour.replace(hour=0), key, model), UsageTotals()).add(totals)
    return rows


async def add_to_rollup(
    session: AsyncSession, table: Table, rows: dict[RollupKey, UsageTotals]
) -> None:
    """Add `rows` into `table`: a new row is inserted, an existing one has every measure
    incremented. Rows go in key order, so concurrent writers lock PostgreSQL rows in one order
    and cannot deadlock; keys are distinct, as one multi-row ON CONFLICT statement requires."""
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert_into = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert_into(table)
    stmt = stmt.on_conflict_do_update(
        index_elements=list(GROUP_KEY),
        set_={m: table.c[m] + stmt.excluded[m] for m in MEASURES},
    )
    params = [
        dict(zip(GROUP_KEY, key, strict=True)) | totals.values()
        for key, totals in sorted(rows.items())
    ]
    await session.execute(stmt, params)


def event_row(e: UsageRecord) -> dict[str, Any]:
    """The `usage_events` row of a record (a shallow copy: `asdict` deep-copies, slowly)."""
    return {**vars(e), "created_at": as_utc(e.created_at)}


class UsageRecorder:
    """Buffers usage records and writes them, with their rollups, in batches of `batch`."""

    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], interval: float = 0.5, batch: int = 2000
    ):
        self.sessions = sessions
        self.interval = interval
        self.batch = batch
        self._buffer: list[UsageRecord] = []
        self._wake = asyncio.Event()
        self._writing = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-recorder")

    def record(self, event: UsageRecord) -> None:
        self._buffer.append(event)
        if len(self._buffer) >= self.batch:
            self._wake.set()

    async def flush(self) -> int:
        """Write everything buffered; returns how many events this call wrote. When it returns,
        every event recorded before the call is committed (a write already under way from
        another caller is waited for)."""
        written = 0
        async with self._writing:
            while self._buffer:
                chunk, self._buffer = self._buffer[: self.batch], self._buffer[self.batch :]
                try:
                    await self._write(chunk)
                except Exception:
                    self._buffer[:0] = chunk
                    raise
                written += len(chunk)
        return written

    async def _write(self, chunk: list[UsageRecord]) -> None:
        async with self.sessions() as session, session.begin():
            await session.execute(insert(usage_events), [event_row(e) for e in chunk])
            hourly = hourly_rollup(chunk)
            await add_to_rollup(session, usage_hourly, hourly)
            await add_to_rollup(session, usage_daily, daily_rollup(hourly))

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception(
                    "usage events could not be written; %d kept for retry", len(self._buffer)
                )
