"""Usage metering: append-only events, written to SQL in batches off the request path, with their
hourly and daily rollups.

`record` only appends to an in-memory buffer; a background task flushes the buffer every
`interval` seconds (or sooner when it fills). One flush of a chunk is one transaction: it inserts
the events and adds them into `usage_hourly` and `usage_daily` (aggregated here first, then one
INSERT … ON CONFLICT DO UPDATE per table), so the rollups always equal the sums of the stored
events. Writing a chunk again is harmless: each event has an id given when it was recorded
(`event_id`, unique in `usage_events`), the insert skips those stored already and only the
events it inserted are added into the rollups. A write whose commit went through but whose
reply was lost (a connection broken at that moment) is taken as failed and tried again; it
bills nothing twice. `close` drains everything, so a clean shutdown loses nothing; while the database is
unavailable the events wait in a bounded buffer and writing is retried with backoff (see
`UsageRecorder`). Usage never passes through Redis, so a Redis restart cannot lose any.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db import Base, UsageEvent, UsageTotals, usage_daily, usage_hourly
from loramux.gateway.db.base import utcnow
from loramux.gateway.db.usage import new_event_id
from loramux.gateway.db.usage_rollup import GROUP_KEY, MEASURES, histogram_bin
from loramux.gateway.usage.unwritten import UnwrittenTokens

usage_events = Base.metadata.tables[UsageEvent.__tablename__]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UsageRecord:
    """One finished or refused request. `created_at` is when it ended; `status` is what the client
    was answered (499: it left first; 429: a quota refused it, `refusal` says which);
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
    admitted_at: datetime | None = None
    """When the request was admitted (its quota reservation made), if it was."""
    refusal: str | None = None
    """For a 429: the limit that refused it (`requests`, `tokens`, `concurrency`, `budget`,
    `backlog`)."""
    event_id: str = field(default_factory=new_event_id)
    """This event's own id (32 hex digits), given when it is recorded: the same in every write
    of it, so the database stores it once however often it is written."""


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
        row.count_outcome(e.status, e.refusal)
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
    params = [
        dict(zip(GROUP_KEY, key, strict=True)) | totals.values()
        for key, totals in sorted(rows.items())
    ]
    await session.execute(_upsert(session.get_bind().dialect.name, table), params)


@functools.cache
def _upsert(dialect: str, table: Table) -> Any:
    """The INSERT … ON CONFLICT that adds rows into `table`, built once per dialect and table:
    its 54 increments took 3 ms of the event loop to build, twice a flush."""
    insert_into = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert_into(table)
    return stmt.on_conflict_do_update(
        index_elements=list(GROUP_KEY),
        set_={m: table.c[m] + stmt.excluded[m] for m in MEASURES},
    )


@functools.cache
def _insert_new(dialect: str) -> Any:
    """The INSERT of events that skips those stored already (by `event_id`) and returns the ids
    of those it inserted."""
    insert_into = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert_into(usage_events).on_conflict_do_nothing(index_elements=["event_id"])
    return stmt.returning(usage_events.c.event_id)


def event_row(e: UsageRecord) -> dict[str, Any]:
    """The `usage_events` row of a record (a shallow copy: `asdict` deep-copies, slowly)."""
    admitted = as_utc(e.admitted_at) if e.admitted_at is not None else None
    return {**vars(e), "created_at": as_utc(e.created_at), "admitted_at": admitted}


class UsageUnavailable(Exception):
    """The database could not take usage events (down, unreachable, locked); they stay buffered."""


EVENT_FAULT_SQLSTATES = ("22", "23")
"""SQLSTATE classes that blame the values written: data exception, integrity violation."""


def blames_the_events(exc: BaseException) -> bool:
    """Whether a failed write was refused because of the events themselves (a value the driver
    or the database rejects: writing them again can never succeed). Every other error
    (connection refused or lost, a locked, starting or stopping database, anything unknown) is
    taken as the database being unavailable, and the events are kept: they are dropped only on
    certain blame."""
    if isinstance(exc, StatementError):
        sqlstate = getattr(exc.orig, "sqlstate", None)
        if isinstance(sqlstate, str):
            return sqlstate[:2] in EVENT_FAULT_SQLSTATES
        if isinstance(exc, DataError | IntegrityError):
            return True
        return isinstance(exc.orig, ArithmeticError | ValueError | TypeError)
    return isinstance(exc, ArithmeticError | ValueError | TypeError)


MAX_RETRY_DELAY = 30.0
"""Longest wait between two attempts while the database is unavailable."""

OUTAGE_LOG_INTERVAL = 10.0


class UsageRecorder:
    """Buffers usage records and writes them, with their rollups, in batches of `batch`.

    While the database is unavailable the events stay buffered, in order, and writing is retried
    with a backoff doubling from `interval` up to MAX_RETRY_DELAY. An event the database refuses
    for its values (`blames_the_events`; the batch is split until the culprit is alone) is
    dropped, so one bad event cannot hold back the others. The buffer holds at most
    `max_buffered` events: past that, new events are dropped. A dropped event is billing data
    lost, the last resort: each is logged at ERROR with every field (enough to bill it by hand)
    and counted in `dropped`.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        interval: float = 0.5,
        batch: int = 2000,
        max_buffered: int = 250_000,
    ):
        self.sessions = sessions
        self.interval = interval
        self.batch = batch
        self.max_buffered = max_buffered
        self.dropped: Counter[str] = Counter()
        """Events given up, by reason: `buffer_full`, `refused` (by the database, on their
        own), `shutdown` (the database was unavailable when the recorder closed, or the event
        came after it closed)."""
        self.failed_attempts = 0
        """Writes failed in a row because the database was unavailable (0 when it is not)."""
        self._buffer: list[UsageRecord] = []
        self.unwritten = UnwrittenTokens()
        """Billable tokens of the buffered events, per tenant, key and day of admission (what a
        rebuilt budget ledger adds to SQL: gateway.quotas.ledger)."""
        self._wake = asyncio.Event()
        self._writing = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        """`close` has returned: nothing writes the buffer any more."""
        self._outage_logged = -OUTAGE_LOG_INTERVAL

    def __len__(self) -> int:
        """Events waiting to be written."""
        return len(self._buffer)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-recorder")

    def record(self, event: UsageRecord) -> None:
        """Buffer `event` (never raises: it runs on the request path). Once the recorder has
        closed nothing would write it: it is dropped (logged), never kept silently."""
        if self._closed:
            self._drop(event, "shutdown", "it ended after the usage recorder closed")
            return
        if len(self._buffer) >= self.max_buffered:
            self._drop(event, "buffer_full", f"{self.max_buffered} events already wait")
            return
        self._buffer.append(event)
        self.unwritten.add(event)
        if len(self._buffer) >= self.batch and not self.failed_attempts:
            self._wake.set()

    async def flush(self) -> int:
        """Write everything buffered; returns how many events this call wrote. When it returns,
        every event recorded before the call is committed or dropped (a write already under way
        from another caller is waited for). Raises UsageUnavailable when the database cannot be
        written; the events not yet written stay buffered, in order."""
        written = 0
        async with self._writing:
            while self._buffer:
                written += await self._write_head()
        return written

    async def _write_head(self) -> int:
        """Write the first `batch` buffered events, removing each part from the buffer once it
        is committed. A part the database refuses is split in two and each half tried in
        order, down to single events; a single event refused is dropped."""
        written = 0
        sizes = [min(self.batch, len(self._buffer))]
        while sizes:
            size = sizes.pop(0)
            part = self._buffer[:size]
            with self.unwritten.writing(part):
                try:
                    await self._write(part)
                except Exception as exc:
                    if not blames_the_events(exc):
                        raise UsageUnavailable(str(exc) or type(exc).__name__) from exc
                    if size > 1:
                        sizes[:0] = [size // 2, size - size // 2]
                        continue
                    self._drop(part[0], "refused", repr(exc))
                else:
                    written += size
                del self._buffer[:size]
                self.unwritten.remove(part)
        return written

    async def _write(self, chunk: list[UsageRecord]) -> None:
        """Store the events of `chunk` not stored yet, and add those into the rollups."""
        async with self.sessions() as session, session.begin():
            insert_new = _insert_new(session.get_bind().dialect.name)
            result = await session.execute(insert_new, [event_row(e) for e in chunk])
            inserted = set(result.scalars())
            hourly = hourly_rollup(e for e in chunk if e.event_id in inserted)
            await add_to_rollup(session, usage_hourly, hourly)
            await add_to_rollup(session, usage_daily, daily_rollup(hourly))

    async def close(self, retry_for: float = 10.0) -> None:
        """Stop the background task and write what is buffered, retrying for up to `retry_for`
        seconds while the database is unavailable; what still cannot be written is dropped
        (logged). Never raises, so the rest of shutdown goes on."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        deadline = time.monotonic() + retry_for
        delay = self.interval
        while True:
            try:
                await self.flush()
                self._closed = True
                return
            except UsageUnavailable as exc:
                self._note_failure(exc)
                if time.monotonic() + delay > deadline:
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RETRY_DELAY)
        self._closed = True
        for event in self._buffer:
            self._drop(event, "shutdown", "the database is unavailable")
        self.unwritten.remove(self._buffer)
        self._buffer.clear()

    async def _run(self) -> None:
        delay = self.interval
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            try:
                await self.flush()
            except UsageUnavailable as exc:
                self._note_failure(exc)
                delay = min(delay * 2, MAX_RETRY_DELAY)
                continue
            except Exception:
                log.exception("usage recorder error; %d events kept for retry", len(self))
                delay = min(delay * 2, MAX_RETRY_DELAY)
                continue
            if self.failed_attempts:
                log.warning(
                    "usage events are written again after %d failed attempts",
                    self.failed_attempts,
                )
            self.failed_attempts = 0
            delay = self.interval

    def _note_failure(self, exc: UsageUnavailable) -> None:
        self.failed_attempts += 1
        now = time.monotonic()
        if now - self._outage_logged >= OUTAGE_LOG_INTERVAL:
            self._outage_logged = now
            log.error(
                "usage events cannot be written (%s); %d buffered (at most %d), retrying",
                exc,
                len(self),
                self.max_buffered,
            )

    def _drop(self, event: UsageRecord, reason: str, why: str) -> None:
        self.dropped[reason] += 1
        log.error(
            "usage event DROPPED (%s: %s), bill it from this line: %s",
            reason,
            why,
            json.dumps(event_row(event), default=str),
        )
