"""What the dashboard shows, gathered from the usage rollups and the quota rows (never from raw
events, so a page costs the same with millions of events), plus the live panel
(`gateway.dashboard.live`).

The window is whole UTC days: the last `days` of them, today included, or `from` to `to`
(dates, both included). Breakdowns: one row per adapter (however a request named it: `bot`,
`acme/bot`, `tnt_…/bot`, `bot@2`), adapters no longer live marked deleted; one row per key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import select

from loramux.cache.tenant_stats import TenantCacheStats
from loramux.gateway.catalog import latest_versions
from loramux.gateway.dashboard.live import EngineHealth, LiveFigures, engine_health, live_figures
from loramux.gateway.dashboard.sources import DashboardSources
from loramux.gateway.db import ApiKey, Tenant, UsageTotals
from loramux.gateway.db.adapter import SHARED_OWNER
from loramux.gateway.db.usage_rollup import REFUSALS
from loramux.gateway.errors import BadRequest, NotFound, PermissionDenied
from loramux.gateway.tenants.lookup import tenant_id_of
from loramux.gateway.usage.outcomes import UNRESOLVED_MODEL
from loramux.gateway.usage.query import Dimension, read_usage
from loramux.gateway.usage.recorder import day_of, hour_of

PERCENTILES = (0.5, 0.9, 0.99)
MAX_DAYS = 366
NOT_SERVED = "(no model)"
"""The row of requests refused before their model was known (a bad body, an unknown model):
usage records them without a model. One refused after its model resolved (a 429, say) is in
that model's row."""


@dataclass(frozen=True)
class TenantRef:
    id: str
    name: str


@dataclass(frozen=True)
class Window:
    """Whole UTC days from `first` to `last`, both included."""

    first: date
    last: date
    custom: bool = False
    """Given as `from`/`to` rather than as a number of days up to today."""

    @property
    def days(self) -> int:
        return (self.last - self.first).days + 1

    @property
    def start(self) -> datetime:
        return datetime.combine(self.first, datetime.min.time(), UTC)

    @property
    def end(self) -> datetime:
        return self.start + timedelta(days=self.days)


def window_of(days: int, first: str | None, last: str | None, now: datetime) -> Window:
    """The last `days` days, or `first` to `last` (ISO dates) when either is given; refused
    (400) when a date is malformed, `first` is after `last`, or it spans over `MAX_DAYS`.
    `days` up to a `last` near 0001-01-01 start there; `last` must leave the window an end
    (the midnight after it), so 9999-12-31 is refused."""
    today = day_of(now).date()
    if not first and not last:
        return Window(_days_up_to(today, days), today)
    end = _date(last, "to") if last else today
    if end == date.max:
        raise BadRequest(
            f"to may be {date.max - timedelta(days=1)} at the latest (the window ends the "
            "midnight after it)",
            param="to",
            code="invalid_request",
        )
    start = _date(first, "from") if first else _days_up_to(end, days)
    if start > end:
        raise BadRequest("'from' must not be after 'to'", param="from", code="invalid_request")
    if (end - start).days >= MAX_DAYS:
        raise BadRequest(f"a window spans at most {MAX_DAYS} days", param="from")
    return Window(start, end, custom=True)


def _days_up_to(last: date, days: int) -> date:
    """The first of the `days` days ending with `last`, or 0001-01-01 if they begin before."""
    return date.fromordinal(max(1, last.toordinal() - (days - 1)))


def _date(value: str, param: str) -> date:
    try:
        if len(value) == 10:
            return date.fromisoformat(value)
    except ValueError:
        pass
    raise BadRequest(f"{param} must be a date (YYYY-MM-DD)", param=param, code="invalid_request")


@dataclass(frozen=True)
class Breakdown:
    label: str
    totals: UsageTotals
    deleted: bool = False
    """An adapter no longer live; a key whose row is gone."""
    revoked: bool = False
    """A key revoked (its row and usage stay)."""


@dataclass(frozen=True)
class DashboardView:
    tenant: TenantRef | None
    """The tenant shown; None: every tenant (admins only)."""
    tenants: list[TenantRef]
    """Every tenant, for an admin's picker; empty for a tenant."""
    window: Window
    live: bool
    totals: UsageTotals
    breakdown: list[Breakdown]
    """Per adapter for one tenant, per tenant for all of them; busiest first."""
    keys: list[Breakdown]
    """Per key of the tenant shown (a tenant sees its own keys' usage); busiest first."""
    daily: list[Breakdown]
    """Every day of the window, oldest first, days without traffic included."""
    hourly: list[Breakdown]
    """The last 24 hours, this one included."""
    current: LiveFigures
    """The live panel: limits against their use now, requests in flight; on an admin's
    all-tenants page, every tenant's quota use."""
    engines: list[EngineHealth] = field(default_factory=list)
    """Admins only."""
    cache: TenantCacheStats | None = None
    """The tenant's response-cache counts since this gateway process started."""

    @property
    def days(self) -> int:
        return self.window.days

    @property
    def window_start(self) -> datetime:
        return self.window.start


async def chosen_tenant(
    src: DashboardSources, viewer_tenant: str | None, requested: str | None
) -> str | None:
    """The tenant to show: a tenant sees only itself, by its id or name (asking for another is
    refused, 403, alike whether that one exists or not); an admin sees the one it asks for,
    or every tenant."""
    if viewer_tenant is None:
        return requested or None
    if requested and requested != viewer_tenant:
        async with src.sessions() as session:
            named = await tenant_id_of(session, requested)
        if named != viewer_tenant:
            raise PermissionDenied(
                "a tenant sees its own usage only", param="tenant", code="not_your_tenant"
            )
    return viewer_tenant


async def load_view(
    src: DashboardSources,
    tenant_id: str | None,
    window: Window,
    now: datetime,
    own_key: str | None,
    live: bool = True,
) -> DashboardView:
    """The dashboard of `tenant_id` (None: every tenant; an admin may give its name) over
    `window`; `own_key`: the key of a tenant viewer (None: an admin)."""
    is_admin = own_key is None
    if is_admin and tenant_id is not None:
        async with src.sessions() as session:
            tenant_id = await tenant_id_of(session, tenant_id)
    tenants = await _tenants(src, None if is_admin else tenant_id)
    names = {t.id: t.name for t in tenants}
    if tenant_id is not None and tenant_id not in names:
        raise NotFound(f"no tenant {tenant_id[:100]!r}", param="tenant", code="not_found")
    dimension: Dimension = "model" if tenant_id else "tenant"
    # One read per group and day gives the daily series, the breakdown and the totals.
    groups = await read_usage(
        src.sessions, tenant=tenant_id, start=window.start, end=window.end, by=[dimension, "day"]
    )
    daily, by_group, totals = _sum_by(groups, 1), _sum_by(groups, 0), UsageTotals()
    for t in by_group.values():
        totals.add(t)
    hour = hour_of(now)
    hourly = await _read(src, tenant_id, hour - timedelta(hours=23), "hour")
    days = [window.start + timedelta(days=i) for i in range(window.days)]
    return DashboardView(
        tenant=TenantRef(tenant_id, names[tenant_id]) if tenant_id else None,
        tenants=tenants if is_admin else [],
        window=window,
        live=live,
        totals=totals,
        breakdown=_busiest(
            await _per_adapter(src, tenant_id, names[tenant_id], by_group)
            if tenant_id
            else [Breakdown(names.get(k, k), t) for k, t in by_group.items()]
        ),
        keys=await _per_key(src, tenant_id, window) if tenant_id else [],
        daily=_every(daily, days, "%Y-%m-%d"),
        hourly=_every(
            hourly, [hour - timedelta(hours=23 - i) for i in range(24)], "%Y-%m-%dT%H:00"
        ),
        current=await live_figures(src, tenant_id, now, own_key),
        engines=await engine_health(src) if is_admin else [],
        cache=src.cache.tenant_stats(tenant_id) if tenant_id else None,
    )


def _busiest(rows: list[Breakdown]) -> list[Breakdown]:
    return sorted(rows, key=lambda b: (-b.totals.requests, b.label))


async def _per_adapter(
    src: DashboardSources, tenant_id: str, tenant_name: str, by_model: dict[str, UsageTotals]
) -> list[Breakdown]:
    """One row per adapter however requests named it; adapters not live now are marked."""
    async with src.sessions() as session:
        live = await latest_versions(session, [tenant_id, SHARED_OWNER])
    own = {r.name for r in live if r.owner == tenant_id}
    shared = {r.name for r in live if r.owner == SHARED_OWNER}
    rows: dict[str, UsageTotals] = {}
    for model, totals in by_model.items():
        label = _adapter_label(model, tenant_id, tenant_name)
        rows.setdefault(label, UsageTotals()).add(totals)
    served = own | {f"shared/{n}" for n in shared} | {src.model_name, NOT_SERVED}
    return [Breakdown(label, t, deleted=label not in served) for label, t in rows.items()]


def _adapter_label(model: str, tenant_id: str, tenant_name: str) -> str:
    """The adapter a request's `model` named: the tenant's own by bare name, shared ones as
    `shared/name`; a version pin is dropped (the row is the adapter's). Usage records adapters
    so (`ResolvedModel.billed_as`); rows of earlier releases hold the name as requested."""
    if model == UNRESOLVED_MODEL:
        return NOT_SERVED
    name = model.rpartition("@")[0] if "@" in model else model
    owner, _, bare = name.rpartition("/")
    if owner in (tenant_id, tenant_name):
        return bare
    return name


async def _per_key(src: DashboardSources, tenant_id: str, window: Window) -> list[Breakdown]:
    """One row per key that made requests in the window; revoked keys and keys whose row is
    gone are marked."""
    groups = await read_usage(
        src.sessions, tenant=tenant_id, start=window.start, end=window.end, by=["key"]
    )
    query = select(ApiKey.id, ApiKey.name, ApiKey.revoked_at).where(ApiKey.tenant_id == tenant_id)
    async with src.sessions() as session:
        keys = {
            key_id: (name, revoked_at) for key_id, name, revoked_at in await session.execute(query)
        }
    rows = []
    for (key_id,), totals in groups.items():
        name, revoked_at = keys.get(key_id, (None, None))
        label = f"lmx-{key_id}" + (f" ({name})" if name else "")
        deleted, revoked = key_id not in keys, revoked_at is not None
        rows.append(Breakdown(label, totals, deleted=deleted, revoked=revoked))
    return _busiest(rows)


async def _tenants(src: DashboardSources, only: str | None) -> list[TenantRef]:
    """Every tenant by name, or only the one with id `only`."""
    stmt = select(Tenant.id, Tenant.name).order_by(Tenant.name)
    if only is not None:
        stmt = stmt.where(Tenant.id == only)
    async with src.sessions() as session:
        return [TenantRef(t.id, t.name) for t in await session.execute(stmt)]


async def _read(
    src: DashboardSources, tenant_id: str | None, start: datetime, dimension: Dimension
) -> dict[str, UsageTotals]:
    groups = await read_usage(src.sessions, tenant=tenant_id, start=start, end=None, by=[dimension])
    return {key[0]: totals for key, totals in groups.items()}


def _sum_by(groups: dict[tuple[str, ...], UsageTotals], part: int) -> dict[str, UsageTotals]:
    """`groups` summed over every part of their key but `part`."""
    sums: dict[str, UsageTotals] = {}
    for key, totals in groups.items():
        sums.setdefault(key[part], UsageTotals()).add(totals)
    return sums


def _every(groups: dict[str, UsageTotals], buckets: list[datetime], fmt: str) -> list[Breakdown]:
    return [Breakdown(b.strftime(fmt), groups.get(b.strftime(fmt), UsageTotals())) for b in buckets]


def totals_json(t: UsageTotals) -> dict[str, Any]:
    return {
        "requests": t.requests,
        "errors": t.errors,
        "aborts": t.aborts,
        "refusals": {name.removeprefix("refused_"): getattr(t, name) for name in REFUSALS},
        "client_errors": t.client_errors,
        "server_errors": t.server_errors,
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
        "from": view.window.first.isoformat(),
        "to": view.window.last.isoformat(),
        "days": view.days,
        "totals": totals_json(view.totals),
        "breakdown": [
            {"group": b.label, "deleted": b.deleted} | totals_json(b.totals) for b in view.breakdown
        ],
        "keys": [
            {"key": b.label, "revoked": b.revoked, "deleted": b.deleted} | totals_json(b.totals)
            for b in view.keys
        ],
        "daily": [{"day": b.label} | totals_json(b.totals) for b in view.daily],
        "live_available": view.current.available,
        "in_flight": view.current.in_flight,
        "quotas": [
            {"scope": q.scope, "limit": q.limit, "value": q.value, "used": q.used}
            | {"period": q.period}
            for q in view.current.quotas
        ],
    }
