"""Usage totals over any time range, read from the rollups so the cost does not grow with the
number of events.

A range `[start, end)` (None: unbounded) is cut into spans: the whole UTC days inside it are read
from `usage_daily`, the whole hours left at its ends from `usage_hourly`, and only what is left
beyond those (less than an hour at each end, for bounds that are not on a whole hour) from
`usage_events`. Every span answers the same measures, which merge by addition, so the result is
exactly what summing the events would give. Grouping by hour reads no daily rollups.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import ColumnElement, FromClause, Select, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db import UsageEvent, UsageTotals, usage_daily, usage_hourly
from loramux.gateway.db.usage_rollup import BOUNDS_MS, CLIENT_CLOSED, MEASURES, REFUSALS
from loramux.gateway.usage.recorder import as_utc, day_of, hour_of

Dimension = Literal["tenant", "key", "model", "day", "hour"]
"""What totals can be grouped by: `day` labels are `YYYY-MM-DD`, `hour` labels
`YYYY-MM-DDTHH:00` (UTC)."""
Grain = Literal["day", "hour", "event"]
GroupKey = tuple[str, ...]


@dataclass(frozen=True)
class Span:
    """A part of a range read from one source; None bounds are open."""

    grain: Grain
    start: datetime | None
    end: datetime | None


_FLOOR: dict[Grain, Callable[[datetime], datetime]] = {"day": day_of, "hour": hour_of}
_STEP: dict[Grain, timedelta] = {"day": timedelta(days=1), "hour": timedelta(hours=1)}


def spans(
    start: datetime | None, end: datetime | None, grains: Sequence[Grain] = ("day", "hour")
) -> list[Span]:
    """`[start, end)` as spans of the coarsest grain that fits, in time order; the spans cover
    the range exactly and do not overlap. `grains` go from coarse to fine; events close them."""
    if start is not None and end is not None and start >= end:
        return []
    if not grains:
        return [Span("event", start, end)]
    grain, finer = grains[0], grains[1:]
    low = _ceil(start, grain) if start is not None else None
    high = _FLOOR[grain](end) if end is not None else None
    no_whole_grain = start is not None and low is None
    if no_whole_grain or (low is not None and high is not None and low >= high):
        return spans(start, end, finer)
    before = spans(start, low, finer) if start is not None else []
    after = spans(high, end, finer) if end is not None else []
    return [*before, Span(grain, low, high), *after]


def _ceil(ts: datetime, grain: Grain) -> datetime | None:
    """The first `grain` boundary at or after `ts`; None in the last hour or day a datetime
    can hold (9999-12-31), which has no boundary after it."""
    floor = _FLOOR[grain](ts)
    if floor == as_utc(ts):
        return floor
    try:
        return floor + _STEP[grain]
    except OverflowError:
        return None


@dataclass(frozen=True)
class _Source:
    """One table seen as usage: its time, tenant, key and model columns and `MEASURES` sums."""

    table: FromClause
    time: ColumnElement[Any]
    tenant: ColumnElement[str]
    key: ColumnElement[str]
    model: ColumnElement[str]
    measures: Sequence[ColumnElement[Any]]


def _rollup_source(grain: Literal["day", "hour"]) -> _Source:
    table = usage_daily if grain == "day" else usage_hourly
    c = table.c
    measures = [func.sum(c[m]) for m in MEASURES]
    return _Source(table, c.bucket, c.tenant_id, c.key_id, c.model, measures)


def _event_source() -> _Source:
    table = UsageEvent.__table__
    e = table.c

    def count(condition: ColumnElement[bool]) -> ColumnElement[Any]:
        return func.sum(case((condition, 1), else_=0))

    def histogram(column: ColumnElement[Any]) -> list[ColumnElement[Any]]:
        edges: list[float | None] = [None, *BOUNDS_MS, None]
        return [count(_in_bin(column, low, high)) for low, high in itertools.pairwise(edges)]

    measures = [
        func.count(e.id),
        count(e.status >= 400),
        func.sum(e.prompt_tokens),
        func.sum(e.completion_tokens),
        func.sum(e.cached_tokens),
        count(e.cache == "exact"),
        count(e.cache == "semantic"),
        func.count(e.ttft_ms),
        count(e.status == CLIENT_CLOSED),
        *(count((e.status == 429) & _refused_by(e.refusal, r)) for r in REFUSALS),
        count((e.status >= 400) & (e.status < 500) & e.status.not_in((429, CLIENT_CLOSED))),
        count(e.status >= 500),
        func.sum(e.latency_ms),
        func.sum(e.ttft_ms),
        *histogram(e.latency_ms),
        *histogram(e.ttft_ms),
    ]
    return _Source(table, e.created_at, e.tenant_id, e.key_id, e.model, measures)


def _refused_by(refusal: ColumnElement[Any], counter: str) -> ColumnElement[bool]:
    """Whether a 429's `refusal` counts in `counter`; one with no known limit counts as
    `refused_requests`, as `UsageTotals.count_outcome` counts it."""
    others = [r.removeprefix("refused_") for r in REFUSALS if r != "refused_requests"]
    if counter == "refused_requests":
        return refusal.is_(None) | refusal.not_in(others)
    return refusal == counter.removeprefix("refused_")


def _in_bin(column: ColumnElement[Any], low: float | None, high: float | None) -> Any:
    """`low < column <= high`, an open end where None (NULL is in no bin)."""
    if low is None:
        return column <= high
    if high is None:
        return column > low
    return (column > low) & (column <= high)


def _label(source: _Source, dimension: Dimension, dialect: str) -> ColumnElement[Any]:
    if dimension in ("tenant", "key", "model"):
        return {"tenant": source.tenant, "key": source.key, "model": source.model}[dimension]
    if dialect == "postgresql":
        pattern = "YYYY-MM-DD" if dimension == "day" else 'YYYY-MM-DD"T"HH24:00'
        return func.to_char(func.timezone("UTC", source.time), pattern)
    return func.strftime("%Y-%m-%d" if dimension == "day" else "%Y-%m-%dT%H:00", source.time)


def _statement(
    span: Span, tenant: str | None, by: Sequence[Dimension], dialect: str
) -> Select[Any]:
    source = _event_source() if span.grain == "event" else _rollup_source(span.grain)
    labels = [_label(source, d, dialect) for d in by]
    stmt = select(*labels, *source.measures).select_from(source.table)
    if tenant is not None:
        stmt = stmt.where(source.tenant == tenant)
    if span.start is not None:
        stmt = stmt.where(source.time >= as_utc(span.start))
    if span.end is not None:
        stmt = stmt.where(source.time < as_utc(span.end))
    return stmt.group_by(*labels) if labels else stmt


async def read_usage(
    sessions: async_sessionmaker[AsyncSession],
    *,
    tenant: str | None,
    start: datetime | None,
    end: datetime | None,
    by: Sequence[Dimension] = (),
) -> dict[GroupKey, UsageTotals]:
    """Totals of the events of `tenant` (None: every tenant) created in `[start, end)`, per
    distinct value of the `by` dimensions (a key is the tuple of their labels). Groups without
    events are absent; with `by` empty the one key is `()`."""
    grains: Sequence[Grain] = ("hour",) if "hour" in by else ("day", "hour")
    merged: dict[GroupKey, UsageTotals] = {}
    async with sessions() as session:
        dialect = session.get_bind().dialect.name
        for span in spans(start, end, grains):
            result = await session.execute(_statement(span, tenant, by, dialect))
            for row in result:
                totals = UsageTotals.from_values(row[len(by) :])
                if totals.requests == 0:
                    continue
                key = tuple(str(v) for v in row[: len(by)])
                merged.setdefault(key, UsageTotals()).add(totals)
    return merged
