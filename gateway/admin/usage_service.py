"""Usage summaries over `usage_events`, aggregated in SQL (SQLite and PostgreSQL alike).

Bounds: `from` is inclusive and `to` exclusive; an ISO date means midnight UTC, except that a
date given as `to` includes that whole day; a time without an offset is UTC. Days are UTC days.
A request is a cache hit when the response cache answered it (`exact` or `semantic`) and an
error when its status was 400 or more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any, Literal

from sqlalchemy import SQLColumnExpression, case, func, select

from gateway.admin.schemas import UsageReport, UsageRow, utc
from gateway.db import UsageEvent
from gateway.errors import BadRequest
from gateway.state import GatewayState

GroupBy = Literal["day", "adapter", "key"]
CACHE_HITS = ("exact", "semantic")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@dataclass(frozen=True)
class UsageQuery:
    tenant: str | None
    start: datetime | None
    end: datetime | None
    group_by: GroupBy


def parse_query(
    tenant: str | None, start: str | None, end: str | None, group_by: str
) -> UsageQuery:
    if group_by not in ("day", "adapter", "key"):
        raise BadRequest(
            "group_by is one of day, adapter, key", param="group_by", code="invalid_request"
        )
    query = UsageQuery(
        tenant=tenant or None,
        start=_bound(start, "from", whole_day=False),
        end=_bound(end, "to", whole_day=True),
        group_by=group_by,  # type: ignore[arg-type]
    )
    if query.start is not None and query.end is not None and query.start >= query.end:
        raise BadRequest("'from' must be before 'to'", param="from", code="invalid_request")
    return query


def _bound(value: str | None, param: str, whole_day: bool) -> datetime | None:
    if not value:
        return None
    try:
        if _DATE.fullmatch(value):
            day = datetime.combine(datetime.fromisoformat(value).date(), time(), UTC)
            return day + timedelta(days=1) if whole_day else day
        return utc(datetime.fromisoformat(value))
    except ValueError:
        raise BadRequest(
            f"{param} must be an ISO date or time, not {value!r}",
            param=param,
            code="invalid_request",
        ) from None


async def summarize(gw: GatewayState, query: UsageQuery) -> UsageReport:
    """One row per group, ordered by group."""
    group = _group_columns(query.group_by, gw.db.dialect.name)
    stmt = select(*group, *_aggregates()).group_by(*group).order_by(*group)
    if query.tenant is not None:
        stmt = stmt.where(UsageEvent.tenant_id == query.tenant)
    # The bounds are UTC: SQLite compares the stored UTC digits, PostgreSQL the instants.
    if query.start is not None:
        stmt = stmt.where(UsageEvent.created_at >= query.start)
    if query.end is not None:
        stmt = stmt.where(UsageEvent.created_at < query.end)
    async with gw.sessions() as session:
        result = await session.execute(stmt)
        rows = [_row(query.group_by, tuple(r)) for r in result]
    return UsageReport(query.group_by, query.tenant, query.start, query.end, rows)


def _group_columns(group_by: GroupBy, dialect: str) -> list[SQLColumnExpression[Any]]:
    if group_by == "adapter":
        return [UsageEvent.tenant_id, UsageEvent.model]
    if group_by == "key":
        return [UsageEvent.tenant_id, UsageEvent.key_id]
    if dialect == "postgresql":
        utc_time = func.timezone("UTC", UsageEvent.created_at)
        return [func.to_char(utc_time, "YYYY-MM-DD").label("day")]
    return [func.date(UsageEvent.created_at).label("day")]


def _aggregates() -> list[SQLColumnExpression[Any]]:
    def total(column: SQLColumnExpression[Any]) -> SQLColumnExpression[Any]:
        return func.coalesce(func.sum(column), 0)

    return [
        func.count(UsageEvent.id),
        total(UsageEvent.prompt_tokens),
        total(UsageEvent.completion_tokens),
        total(UsageEvent.cached_tokens),
        total(case((UsageEvent.cache.in_(CACHE_HITS), 1), else_=0)),
        total(case((UsageEvent.status >= 400, 1), else_=0)),
        func.coalesce(func.avg(UsageEvent.latency_ms), 0.0),
    ]


def _row(group_by: GroupBy, values: tuple[Any, ...]) -> UsageRow:
    if group_by == "day":
        (group,), tenant_id, numbers = values[:1], None, values[1:]
    else:
        tenant_id, group, numbers = values[0], values[1], values[2:]
    requests, prompt, completion, cached, hits, errors, latency = numbers
    return UsageRow(
        group=str(group),
        tenant_id=tenant_id,
        requests=int(requests),
        prompt_tokens=int(prompt),
        completion_tokens=int(completion),
        cached_tokens=int(cached),
        cache_hits=int(hits),
        errors=int(errors),
        mean_latency_ms=float(latency),
    )
