"""Usage summaries, read from the hourly and daily rollups (see `gateway.usage.query`).

Bounds: `from` is inclusive and `to` exclusive; an ISO date means midnight UTC, except that a
date given as `to` includes that whole day; a time without an offset is UTC. Days are UTC days.
A bound UTC cannot express (before 0001-01-01 or past 9999-12-31) is a 400.
A request is a cache hit when the response cache answered it (`exact` or `semantic`) and an
error when its status was 400 or more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime, time, timedelta
from typing import Literal

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.admin.wire import utc_input
from loramux.gateway.db import UsageTotals
from loramux.gateway.db.usage_rollup import REFUSALS
from loramux.gateway.errors import BadRequest
from loramux.gateway.tenants.lookup import tenant_id_of
from loramux.gateway.usage.query import Dimension, read_usage
from loramux.gateway.usage.schemas import UsageReport, UsageRow

GroupBy = Literal["day", "adapter", "key"]
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


@dataclass(frozen=True)
class UsageQuery:
    tenant: str | None
    start: datetime | None
    end: datetime | None
    group_by: GroupBy


def parse_query(
    tenant: str | None, start: str | None, end: str | None, group_by: GroupBy
) -> UsageQuery:
    query = UsageQuery(
        tenant=tenant or None,
        start=_bound(start, "from", whole_day=False),
        end=_bound(end, "to", whole_day=True),
        group_by=group_by,
    )
    if query.start is not None and query.end is not None and query.start >= query.end:
        raise BadRequest("'from' must be before 'to'", param="from", code="invalid_request")
    return query


def _bound(value: str | None, param: str, whole_day: bool) -> datetime | None:
    """`value` as a time in UTC; a date as `to` is the end of its day, so `to` 9999-12-31
    (whose end no time can hold) is out of range, as is a time an offset carries past UTC's."""
    if not value:
        return None
    try:
        if not _DATE.fullmatch(value):
            return utc_input(datetime.fromisoformat(value), param)
        day = datetime.combine(datetime.fromisoformat(value).date(), time(), UTC)
        return day + timedelta(days=1) if whole_day else day
    except ValueError:
        raise BadRequest(
            f"{param} must be an ISO date or time, not {value!r}",
            param=param,
            code="invalid_request",
        ) from None
    except OverflowError:  # a date as `to` ends at the next midnight; 9999-12-31 has none
        raise BadRequest(
            f"{param} {value!r} is out of range: as a date it ends at the midnight after it, "
            "past 9999-12-31 (give a time, or leave it out)",
            param=param,
            code="invalid_request",
        ) from None


_DIMENSIONS: dict[GroupBy, tuple[Dimension, ...]] = {
    "day": ("day",),
    "adapter": ("tenant", "model"),
    "key": ("tenant", "key"),
}


class UsageReports:
    """Usage reports, read in sessions of their own (`read_usage` reads its spans at once)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def summarize(self, query: UsageQuery) -> UsageReport:
        """One row per group, ordered by group; read from the usage rollups. `query.tenant` is
        a tenant's id or name."""
        if query.tenant is not None:
            async with self.sessions() as session:
                query = replace(query, tenant=await tenant_id_of(session, query.tenant))
        groups = await read_usage(
            self.sessions,
            tenant=query.tenant,
            start=query.start,
            end=query.end,
            by=_DIMENSIONS[query.group_by],
        )
        rows = [_row(query.group_by, key, totals) for key, totals in sorted(groups.items())]
        return UsageReport(query.group_by, query.tenant, query.start, query.end, rows)


def refusals_by_limit(totals: UsageTotals) -> dict[str, int]:
    return {name.removeprefix("refused_"): getattr(totals, name) for name in REFUSALS}


def _row(group_by: GroupBy, key: tuple[str, ...], totals: UsageTotals) -> UsageRow:
    tenant_id, group = (None, key[0]) if group_by == "day" else key
    return UsageRow(
        group=group,
        tenant_id=tenant_id,
        requests=totals.requests,
        prompt_tokens=totals.prompt_tokens,
        completion_tokens=totals.completion_tokens,
        cached_tokens=totals.cached_tokens,
        cache_hits=totals.cache_hits,
        errors=totals.errors,
        aborts=totals.aborts,
        refusals=refusals_by_limit(totals),
        client_errors=totals.client_errors,
        server_errors=totals.server_errors,
        mean_latency_ms=totals.mean_latency_ms,
    )
