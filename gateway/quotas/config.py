"""Which limits apply to a request: the tenant's quota row and its key's, read from SQL and
cached in-process so that admission costs no SQL on the hot path.

A key's limits are cached for `ttl` seconds (LORAMUX_QUOTA_CONFIG_CACHE_SECONDS, 1 s by
default): a quota change made through the admin API applies in every gateway process within that
time. Concurrent misses for one key share a single query. When the database cannot be read, the
last limits read are used (however old) rather than refusing traffic; with none, the error
propagates.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db import Quota
from loramux.gateway.quotas.single_flight import SingleFlight

log = logging.getLogger(__name__)

MAX_CACHED_KEYS = 100_000
"""Cached keys at most; past this the cache is dropped and refilled on demand."""


@dataclass(frozen=True)
class ScopeLimits:
    """The limits of one scope (a tenant, or one of its keys); None is no limit."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    token_budget: int | None = None
    budget_period: str | None = None
    """`day` or `month` (UTC calendar periods); set whenever token_budget is."""

    @classmethod
    def of(cls, row: Quota | None) -> ScopeLimits:
        if row is None:
            return cls()
        return cls(row.rpm, row.tpm, row.max_concurrent, row.token_budget, row.budget_period)


@dataclass(frozen=True)
class PrincipalLimits:
    """Every limit a request through one key meets: its tenant's and its key's."""

    tenant: ScopeLimits
    key: ScopeLimits


@dataclass
class _Entry:
    limits: PrincipalLimits
    fetched: float


class QuotaConfig:
    """Limits per (tenant, key), from the `quotas` table, cached for `ttl` seconds."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl: float):
        self.sessions = sessions
        self.ttl = ttl
        self._cache: dict[tuple[str, str], _Entry] = {}
        self._flight: SingleFlight[tuple[str, str], PrincipalLimits] = SingleFlight()

    async def limits(self, tenant_id: str, key_id: str) -> PrincipalLimits:
        ident = (tenant_id, key_id)
        entry = self._cache.get(ident)
        if entry is not None and time.monotonic() - entry.fetched < self.ttl:
            return entry.limits
        return await self._flight.run(ident, lambda: self._refresh(ident))

    async def _refresh(self, ident: tuple[str, str]) -> PrincipalLimits:
        try:
            limits = await self._read(*ident)
        except Exception as exc:
            entry = self._cache.get(ident)
            if entry is None:
                raise
            log.warning("quota rows unreadable (%s); using the last ones read", exc)
            return entry.limits
        if len(self._cache) >= MAX_CACHED_KEYS:
            self._cache.clear()
        self._cache[ident] = _Entry(limits, time.monotonic())
        return limits

    async def _read(self, tenant_id: str, key_id: str) -> PrincipalLimits:
        async with self.sessions() as session:
            rows = (
                await session.scalars(
                    select(Quota).where(
                        Quota.tenant_id == tenant_id,
                        or_(Quota.key_id.is_(None), Quota.key_id == key_id),
                    )
                )
            ).all()
        tenant = next((r for r in rows if r.key_id is None), None)
        key = next((r for r in rows if r.key_id == key_id), None)
        return PrincipalLimits(ScopeLimits.of(tenant), ScopeLimits.of(key))
