"""Response-cache administration: a tenant's cache settings, and purging cached responses.

Settings live in `Tenant.settings["cache"]` (see `gateway.cache_policy`); an update changes only
the fields it names and takes effect at once in this process (the tenant's keys are dropped from
the key cache, which carries the settings), within LORAMUX_KEY_CACHE_SECONDS elsewhere.

A purge names the tenant and, optionally, an adapter: `owner/name` (every version of it), a
bare name (the tenant's own adapter, else the shared one), a content digest, or `base`.
"""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.cache.response_cache import ResponseCache
from loramux.cache.threshold import choose_threshold, score_pairs
from loramux.gateway.auth.api_keys import ApiKeyAuth
from loramux.gateway.cache.schemas import (
    CacheSettingsOut,
    CacheStatsOut,
    ThresholdTuned,
    ThresholdTuning,
)
from loramux.gateway.cache_policy import TenantCacheSettings
from loramux.gateway.db import AdapterVersion, ApiKey
from loramux.gateway.db.adapter import SHARED_OWNER
from loramux.gateway.errors import NotFound, ServiceUnavailable, Unprocessable
from loramux.gateway.request_ids import request_id_of
from loramux.gateway.tenants.lookup import get_locked_tenant, get_tenant, owner_id, tenant_id_of

_DIGEST = re.compile(r"^[0-9a-f]{16,64}$")


class CacheAdmin:
    """Cache settings and purges over one database session (one request's)."""

    def __init__(
        self, session: AsyncSession, keys: ApiKeyAuth, response_cache: ResponseCache
    ) -> None:
        self.session = session
        self.keys = keys
        self.response_cache = response_cache

    async def get_settings(self, ref: str) -> CacheSettingsOut:
        tenant = await get_tenant(self.session, ref)
        return _out(tenant.id, TenantCacheSettings.of(tenant.settings or {}))

    async def update_settings(self, ref: str, changes: dict[str, object]) -> CacheSettingsOut:
        # Locked and read under the lock: a delete of the tenant either commits first (404
        # here) or waits, and a concurrent write of its other settings is not lost.
        tenant = await get_locked_tenant(self.session, ref)
        tenant_id = tenant.id
        current = dict(tenant.settings or {})
        merged = TenantCacheSettings.of(current).as_dict() | changes
        # A new dict: the JSON column only notices reassignment.
        tenant.settings = current | {"cache": merged}
        await self.session.commit()
        key_ids = await self.session.scalars(select(ApiKey.id).where(ApiKey.tenant_id == tenant_id))
        for key_id in key_ids:
            self.keys.forget(key_id)
        return _out(tenant_id, TenantCacheSettings.of({"cache": merged}))

    async def purge(self, ref: str, adapter: str | None) -> int:
        """Entries removed from the tenant's (by id or name); ServiceUnavailable when Redis
        cannot be reached."""
        tenant_id = await tenant_id_of(self.session, ref)
        digests: list[str | None] = [None]
        if adapter is not None:
            digests = list(await _digests(self.session, tenant_id, adapter))
        try:
            return sum([await self.response_cache.purge(tenant_id, d) for d in digests])
        except Exception as exc:
            raise ServiceUnavailable(
                f"the response cache is unavailable: {exc}", code="cache_unavailable"
            ) from exc

    async def report_wrong_hit(self, tenant_id: str, reported: str) -> None:
        """Invalidate the entry that answered the tenant's request, named by its response's `id`
        or the gateway's request id. NotFound alike for an unknown tenant, an unknown request
        and another tenant's request (nothing says which)."""
        tenant_id = (await get_tenant(self.session, tenant_id)).id
        request_id = request_id_of(reported)
        try:
            found = await self.response_cache.report_wrong_hit(tenant_id, request_id)
        except Exception as exc:
            raise ServiceUnavailable(
                f"the response cache is unavailable: {exc}", code="cache_unavailable"
            ) from exc
        if not found:
            raise NotFound(
                "no cached response is on record for that request of that tenant",
                param="request_id",
                code="request_not_found",
            )

    async def stats(self, ref: str) -> CacheStatsOut:
        """The counters of the tenant whose id or name is `ref`."""
        tenant_id = (await get_tenant(self.session, ref)).id
        counts = self.response_cache.tenant_stats(tenant_id).as_dict()
        return CacheStatsOut(tenant_id=tenant_id, **counts)

    async def tune_threshold(self, tenant_id: str, data: ThresholdTuning) -> ThresholdTuned:
        """Set the tenant's threshold from its labelled pairs (`cache.threshold`)."""
        await get_tenant(self.session, tenant_id)
        pairs = [(p.a, p.b, p.same) for p in data.pairs]
        scored = await score_pairs(self.response_cache.embedder, pairs)
        choice = choose_threshold(scored, data.objective, data.min_precision)
        if choice is None:
            raise Unprocessable(
                "no threshold serves any labelled paraphrase at that precision",
                param="pairs",
                code="no_threshold",
            )
        threshold = round(choice.threshold, 4)
        await self.update_settings(tenant_id, {"threshold": threshold})
        return ThresholdTuned(threshold, choice.precision, choice.recall, choice.f1, len(pairs))


def _out(tenant_id: str, settings: TenantCacheSettings) -> CacheSettingsOut:
    return CacheSettingsOut(tenant_id=tenant_id, **settings.as_dict())


async def _owner(session: AsyncSession, ref: str) -> str:
    """An adapter owner named by id or name (`shared` included); an unknown one as written, so
    that it finds no adapter."""
    try:
        return await owner_id(session, ref)
    except NotFound:
        return ref


async def _digests(session: AsyncSession, tenant_id: str, adapter: str) -> list[str]:
    if adapter == "base" or _DIGEST.match(adapter):
        return [adapter]
    if "/" in adapter:
        owner, name = adapter.split("/", 1)
        owners = [await _owner(session, owner)]
    else:
        name, owners = adapter, [tenant_id, SHARED_OWNER]
    for owner in owners:
        rows = await session.scalars(
            select(AdapterVersion.digest).where(
                AdapterVersion.owner == owner, AdapterVersion.name == name
            )
        )
        found = sorted(set(rows))
        if found:
            return found
    raise NotFound(f"no adapter {adapter!r}", param="adapter", code="adapter_not_found")
