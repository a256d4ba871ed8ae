"""What the dashboard shows, gathered from the usage rollups and the quota rows (never from raw
events, so a page costs the same with millions of events).

The window is the last `days` whole UTC days, today included. Budgets are counted over the
current UTC day or month, as the limiter's ledgers are; the tokens counted are prompt plus
completion tokens, as usage events record them (a cache hit records none).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from gateway.db import ApiKey, Quota, Tenant, UsageTotals
from gateway.errors import NotFound, PermissionDenied
from gateway.quotas.buckets import budget_period
from gateway.state import GatewayState
from gateway.usage.query import Dimension, read_usage
from gateway.usage.recorder import day_of, hour_of

PERCENTILES = (0.5, 0.9, 0.99)
LIMITS = (
    ("rpm", "requests per minute"),
    ("tpm", "tokens per minute"),
    ("max_concurrent", "concurrent requests"),
)


@dataclass(frozen=True)
class TenantRef:
    id: str
    name: str


@dataclass(frozen=True)
class QuotaLine:
    """One limit of the tenant or of one of its keys; `used` is set for budgets only."""

    scope: str
    limit: str
    value: int
    used: int | None = None
    period: str | None = None

    @property
    def fraction(self) -> float | None:
        return None if self.used is None else min(self.used / self.value, 1.0)


@dataclass(frozen=True)
class Breakdown:
    label: str
    totals: UsageTotals


@dataclass(frozen=True)
class DashboardView:
    tenant: TenantRef | None
    """The tenant shown; None: every tenant (admins only)."""
    tenants: list[TenantRef]
    """Every tenant, for an admin's picker; empty for a tenant."""
    days: int
    window_start: datetime
    totals: UsageTotals
    breakdown: list[Breakdown]
    """Per adapter (model name) for one tenant, per tenant for all of them; busiest first."""
    daily: list[Breakdown]
    """Every day of the window, oldest first, days without traffic included."""
    hourly: list[Breakdown]
    """The last 24 hours, this one included."""
    quotas: list[QuotaLine]


def chosen_tenant(viewer_tenant: str | None, requested: str | None) -> str | None:
    """The tenant to show: a tenant sees only itself (asking for another is refused, 403); an
    admin sees the one it asks for, or every tenant."""
    if viewer_tenant is None:
        return requested or None
    if requested and requested != viewer_tenant:
        raise PermissionDenied("a tenant sees its own usage only", param="tenant")
    return viewer_tenant


async def load_view(
    gw: GatewayState, tenant_id: str | None, days: int, now: datetime, is_admin: bool
) -> DashboardView:
    """The dashboard of `tenant_id` (None: every tenant) over the last `days` days."""
    tenants = await _tenants(gw, None if is_admin else tenant_id)
    names = {t.id: t.name for t in tenants}
    if tenant_id is not None and tenant_id not in names:
        raise NotFound(f"no tenant {tenant_id!r}", param="tenant", code="not_found")
    start, hour = day_of(now) - timedelta(days=days - 1), hour_of(now)
    # One read per group and day gives the daily series, the breakdown and the totals.
    dimension: Dimension = "model" if tenant_id else "tenant"
    window = await read_usage(
        gw.sessions, tenant=tenant_id, start=start, end=None, by=[dimension, "day"]
    )
    daily, groups, totals = _sum_by(window, 1), _sum_by(window, 0), UsageTotals()
    for t in groups.values():
        totals.add(t)
    breakdown = [Breakdown(k if tenant_id else names.get(k, k), t) for k, t in groups.items()]
    hourly = await _read(gw, tenant_id, hour - timedelta(hours=23), "hour")
    return DashboardView(
        tenant=TenantRef(tenant_id, names[tenant_id]) if tenant_id else None,
        tenants=tenants if is_admin else [],
        days=days,
        window_start=start,
        totals=totals,
        breakdown=sorted(breakdown, key=lambda b: (-b.totals.requests, b.label)),
        daily=_every(daily, [start + timedelta(days=i) for i in range(days)], "%Y-%m-%d"),
        hourly=_every(
            hourly, [hour - timedelta(hours=23 - i) for i in range(24)], "%Y-%m-%dT%H:00"
        ),
        quotas=await _quota_lines(gw, tenant_id, now) if tenant_id else [],
    )


async def _tenants(gw: GatewayState, only: str | None) -> list[TenantRef]:
    """Every tenant by name, or only the one with id `only`."""
    stmt = select(Tenant.id, Tenant.name).order_by(Tenant.name)
    if only is not None:
        stmt = stmt.where(Tenant.id == only)
    async with gw.sessions() as session:
        return [TenantRef(t.id, t.name) for t in await session.execute(stmt)]


async def _read(
    gw: GatewayState, tenant_id: str | None, start: datetime, dimension: Dimension
) -> dict[str, UsageTotals]:
    groups = await read_usage(gw.sessions, tenant=tenant_id, start=start, end=None, by=[dimension])
    return {key[0]: totals for key, totals in groups.items()}


def _sum_by(groups: dict[tuple[str, ...], UsageTotals], part: int) -> dict[str, UsageTotals]:
    """`groups` summed over every part of their key but `part`."""
    sums: dict[str, UsageTotals] = {}
    for key, totals in groups.items():
        sums.setdefault(key[part], UsageTotals()).add(totals)
    return sums


def _every(groups: dict[str, UsageTotals], buckets: list[datetime], fmt: str) -> list[Breakdown]:
    return [Breakdown(b.strftime(fmt), groups.get(b.strftime(fmt), UsageTotals())) for b in buckets]


async def _quota_lines(gw: GatewayState, tenant_id: str, now: datetime) -> list[QuotaLine]:
    async with gw.sessions() as session:
        rows = (
            await session.execute(
                select(Quota, ApiKey.name)
                .outerjoin(ApiKey, ApiKey.id == Quota.key_id)
                .where(Quota.tenant_id == tenant_id)
                .order_by(Quota.key_id.is_not(None), Quota.key_id)
            )
        ).all()
    lines: list[QuotaLine] = []
    for quota, key_name in rows:
        scope = "tenant" if quota.key_id is None else f"key lmx-{quota.key_id}"
        scope += f" ({key_name})" if key_name else ""
        for field, text in LIMITS:
            value = getattr(quota, field)
            if value is not None:
                lines.append(QuotaLine(scope, text, value))
        if quota.token_budget is not None and quota.budget_period is not None:
            used = await _budget_used(gw, tenant_id, quota.key_id, quota.budget_period, now)
            limit = f"tokens per {quota.budget_period}"
            lines.append(QuotaLine(scope, limit, quota.token_budget, used, quota.budget_period))
    return lines


async def _budget_used(
    gw: GatewayState, tenant_id: str, key_id: str | None, period: str, now: datetime
) -> int:
    span = budget_period(period, now)
    by: list[Dimension] = ["key"] if key_id is not None else []
    groups = await read_usage(gw.sessions, tenant=tenant_id, start=span.start, end=span.end, by=by)
    totals = groups.get((key_id,) if key_id is not None else ())
    return totals.total_tokens if totals is not None else 0


def totals_json(t: UsageTotals) -> dict[str, Any]:
    return {
        "requests": t.requests,
        "errors": t.errors,
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "cached_tokens": t.cached_tokens,
        "cache_hits": t.cache_hits,
        "exact_hits": t.exact_hits,
        "semantic_hits": t.semantic_hits,
        "cache_hit_rate": t.cache_hit_rate,
        "mean_latency_ms": t.mean_latency_ms,
        "latency_ms": {f"p{round(q * 100)}": t.latency_percentile(q) for q in PERCENTILES},
        "ttft_ms": {f"p{round(q * 100)}": t.ttft_percentile(q) for q in PERCENTILES},
    }


def view_json(view: DashboardView) -> dict[str, Any]:
    """The page's numbers as JSON (`GET /dashboard/data`)."""
    return {
        "tenant": {"id": view.tenant.id, "name": view.tenant.name} if view.tenant else None,
        "from": view.window_start.date().isoformat(),
        "days": view.days,
        "totals": totals_json(view.totals),
        "breakdown": [{"group": b.label} | totals_json(b.totals) for b in view.breakdown],
        "daily": [{"day": b.label} | totals_json(b.totals) for b in view.daily],
        "quotas": [
            {"scope": q.scope, "limit": q.limit, "value": q.value, "used": q.used}
            | {"period": q.period}
            for q in view.quotas
        ],
    }
