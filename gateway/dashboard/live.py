"""The dashboard's live panel: each limit of the tenant (and of the viewer's own key) against what
it is using now, read from the limiter's Redis buckets, and for an admin the engine's health and
the quota use of every tenant with limits.

A tenant sees the tenant-wide limits and its own key's, never the limits of its other keys.
Budgets are counted over the current UTC day or month from the usage rollups, as the limiter's
ledgers are seeded; per-minute limits and concurrency are read live, each read bounded by the
quota service's Redis timeout. While that Redis is down or silent the page still answers: the
live figures are None and the page says they are unavailable (`LiveFigures.available`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime

from redis.exceptions import RedisError
from sqlalchemy import select

from loramux.gateway.dashboard.sources import DashboardSources
from loramux.gateway.db import ApiKey, Quota, Tenant
from loramux.gateway.quotas.buckets import budget_period
from loramux.gateway.quotas.live import LiveUse, live_use
from loramux.gateway.usage.query import Dimension, read_usage

LIMITS = (
    ("rpm", "requests per minute", "requests"),
    ("tpm", "tokens per minute", "tokens"),
    ("max_concurrent", "concurrent requests", "in_flight"),
)
"""Per-minute and concurrency limits: the quota field, how it reads, the `LiveUse` field."""
MAX_TENANTS_SHOWN = 50
"""The admin's quota table shows this many tenants with limits, by name."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuotaLine:
    scope: str
    limit: str
    value: int
    used: int | None
    """None: a live figure the quota Redis did not give (budgets are read from SQL)."""
    period: str
    """What `used` counts over: `minute`, `now`, or the budget's `day` / `month`."""

    @property
    def fraction(self) -> float:
        if self.used is None:
            return 0.0
        return min(self.used / self.value, 1.0) if self.value else 1.0


@dataclass(frozen=True)
class EngineHealth:
    up: bool
    running: int
    waiting: int
    kv_used: int
    kv_total: int

    @property
    def kv_fraction(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0


@dataclass(frozen=True)
class TenantQuotas:
    name: str
    lines: list[QuotaLine]


@dataclass(frozen=True)
class LiveFigures:
    """The live panel of one page: the shown tenant's limits against their use and its requests
    in flight, or, on an admin's all-tenants page, the quota use of every tenant with limits."""

    quotas: list[QuotaLine]
    in_flight: int | None
    """Requests of the tenant holding a concurrency slot now (0 without a concurrency limit);
    None: the quota Redis did not answer."""
    tenant_quotas: list[TenantQuotas]
    available: bool
    """False when a read of the quota Redis failed or timed out: the figures it did not give
    are None."""


class LiveReads:
    """One page's reads of the limiter's buckets, each bounded by the quota service's Redis
    timeout. After one fails (Redis down, or silent past the timeout) the rest are not tried,
    so a page waits at most one timeout, and `failed` says the page lacks live figures."""

    def __init__(self, src: DashboardSources) -> None:
        self.src = src
        self.failed = False

    async def use(self, tenant_id: str, key_id: str | None) -> LiveUse | None:
        """The scope's use now; None once a read has failed."""
        if self.failed:
            return None
        try:
            async with asyncio.timeout(self.src.redis_timeout):
                return await live_use(self.src.redis, tenant_id, key_id)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("dashboard: no live figures, the quota Redis did not answer: %r", exc)
            self.failed = True
            return None


async def live_figures(
    src: DashboardSources, tenant_id: str | None, now: datetime, own_key: str | None
) -> LiveFigures:
    """The live panel of `tenant_id`'s page (None: every tenant's, an admin's only); `own_key`
    as for `quota_lines`."""
    reads = LiveReads(src)
    if tenant_id is None:
        across = await quotas_across_tenants(src, reads, now) if own_key is None else []
        return LiveFigures([], 0, across, not reads.failed)
    quotas = await quota_lines(src, reads, tenant_id, now, own_key)
    use = await reads.use(tenant_id, None)
    in_flight = use.in_flight if use is not None else None
    return LiveFigures(quotas, in_flight, [], not reads.failed)


async def quota_lines(
    src: DashboardSources, reads: LiveReads, tenant_id: str, now: datetime, own_key: str | None
) -> list[QuotaLine]:
    """The tenant's limits and use; `own_key`: a tenant viewer's key, whose limits are the
    only key limits shown (None: an admin, who sees every key's)."""
    query = (
        select(Quota, ApiKey.name)
        .outerjoin(ApiKey, ApiKey.id == Quota.key_id)
        .where(Quota.tenant_id == tenant_id)
        .order_by(Quota.key_id.is_not(None), Quota.key_id)
    )
    if own_key is not None:
        query = query.where(Quota.key_id.is_(None) | (Quota.key_id == own_key))
    async with src.sessions() as session:
        rows = (await session.execute(query)).all()
    lines: list[QuotaLine] = []
    for quota, key_name in rows:
        scope = "tenant" if quota.key_id is None else f"key lmx-{quota.key_id}"
        scope += f" ({key_name})" if key_name else ""
        if any(getattr(quota, field) is not None for field, _, _ in LIMITS):
            lines += _live_lines(scope, quota, await reads.use(tenant_id, quota.key_id))
        if quota.token_budget is not None and quota.budget_period is not None:
            used = await _budget_used(src, tenant_id, quota.key_id, quota.budget_period, now)
            limit = f"tokens per {quota.budget_period}"
            lines.append(QuotaLine(scope, limit, quota.token_budget, used, quota.budget_period))
    return lines


def _live_lines(scope: str, quota: Quota, use: LiveUse | None) -> list[QuotaLine]:
    return [
        QuotaLine(
            scope,
            text,
            value,
            getattr(use, field) if use is not None else None,
            "now" if field == "in_flight" else "minute",
        )
        for name, text, field in LIMITS
        if (value := getattr(quota, name)) is not None
    ]


async def _budget_used(
    src: DashboardSources, tenant_id: str, key_id: str | None, period: str, now: datetime
) -> int:
    span = budget_period(period, now)
    by: list[Dimension] = ["key"] if key_id is not None else []
    groups = await read_usage(src.sessions, tenant=tenant_id, start=span.start, end=span.end, by=by)
    totals = groups.get((key_id,) if key_id is not None else ())
    return totals.total_tokens if totals is not None else 0


async def engine_health(src: DashboardSources) -> list[EngineHealth]:
    """One line per engine, in engine order (the panel's `#<index in LORAMUX_ENGINE_URLS>`);
    an engine that cannot answer is down, every one of them when none can. A single line,
    down, when no engine is known (none of Ray Serve's replicas is running)."""
    stats = await src.engine.stats()
    return [
        EngineHealth(False, 0, 0, 0, 0)
        if s is None
        else EngineHealth(True, s.running, s.waiting, s.kv_blocks_used, s.kv_blocks_total)
        for s in stats
    ] or [EngineHealth(False, 0, 0, 0, 0)]


async def quotas_across_tenants(
    src: DashboardSources, reads: LiveReads, now: datetime
) -> list[TenantQuotas]:
    """The limits and use of the first `MAX_TENANTS_SHOWN` tenants (by name) that have any."""
    async with src.sessions() as session:
        tenants = (
            await session.execute(
                select(Tenant.id, Tenant.name)
                .where(Tenant.id.in_(select(Quota.tenant_id)))
                .order_by(Tenant.name)
                .limit(MAX_TENANTS_SHOWN)
            )
        ).all()
    return [
        TenantQuotas(name, await quota_lines(src, reads, tid, now, None)) for tid, name in tenants
    ]
