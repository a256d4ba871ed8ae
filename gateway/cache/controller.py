"""Routes: a tenant's response-cache settings (`/admin/tenants/{id}/cache`), its counts
(`…/cache/stats`) and threshold tuning from labelled pairs (`…/cache/threshold`), purges
(`DELETE /admin/cache?tenant=…[&adapter=…]`) and wrong-hit reports (`POST /admin/cache/feedback`)."""

from __future__ import annotations

from litestar import Controller, delete, get, post, put
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody

from loramux.gateway.admin.wire import given
from loramux.gateway.api_docs import admin_errors
from loramux.gateway.audit.action import audited_as
from loramux.gateway.audit.service import AuditRecord
from loramux.gateway.cache.schemas import (
    CacheSettingsOut,
    CacheSettingsUpdate,
    CacheStatsOut,
    Purged,
    ThresholdTuned,
    ThresholdTuning,
    WrongHit,
    WrongHitOut,
)
from loramux.gateway.cache.service import CacheAdmin

_BODY = """Body: any of `enabled`, `semantic`, `cache_sampled` (booleans), `threshold` (0.5 to
1.0), `verifier` (`strict` or `off`), `ttl` (seconds, 1 to 604800), `hit_pacing` (`instant` or
`paced`), `hit_tokens_per_second`; absent fields keep their value. Semantic hits need `semantic: true` here; they are never served to sampled requests."""


class CacheController(Controller):
    path = "/"
    tags = ("admin: cache",)

    @put(
        "/tenants/{tenant:str}/cache",
        description=_BODY,
        responses=admin_errors(400, 404),
        opt=audited_as("cache.settings.set", "{tenant}"),
    )
    async def set_cache_settings(
        self,
        tenant: FromPath[str],
        data: JSONBody[CacheSettingsUpdate],
        cache_admin: NamedDependency[CacheAdmin],
        entry: NamedDependency[AuditRecord],
    ) -> CacheSettingsOut:
        entry.detail = given(data)
        return await cache_admin.update_settings(tenant, given(data))

    @get("/tenants/{tenant:str}/cache", responses=admin_errors(400, 404))
    async def get_cache_settings(
        self, tenant: FromPath[str], cache_admin: NamedDependency[CacheAdmin]
    ) -> CacheSettingsOut:
        return await cache_admin.get_settings(tenant)

    @delete(
        "/cache",
        status_code=200,
        responses=admin_errors(400, 404),
        opt=audited_as("cache.purge"),
    )
    async def purge_cache(
        self,
        tenant: FromQuery[str],
        cache_admin: NamedDependency[CacheAdmin],
        entry: NamedDependency[AuditRecord],
        adapter: FromQuery[str | None] = None,
    ) -> Purged:
        """Remove a tenant's cached responses, or only those of one adapter: `owner/name` (every
        version), a name (the tenant's own, else shared), a digest, or `base`."""
        entry.target = tenant
        entry.detail = {"adapter": adapter}
        purged = await cache_admin.purge(tenant, adapter)
        entry.detail["purged"] = purged
        return Purged(purged)

    @get("/tenants/{tenant_id:str}/cache/stats", responses=admin_errors(400, 404))
    async def get_cache_stats(
        self, tenant_id: FromPath[str], cache_admin: NamedDependency[CacheAdmin]
    ) -> CacheStatsOut:
        """The tenant's hit rate, near-miss rate, verifier refusals by check and wrong hits
        reported, as counted by the gateway process that answers."""
        return await cache_admin.stats(tenant_id)

    @post(
        "/tenants/{tenant_id:str}/cache/threshold",
        status_code=200,
        responses=admin_errors(400, 404, 422),
        opt=audited_as("cache.threshold.tune", "{tenant_id}"),
    )
    async def tune_cache_threshold(
        self,
        tenant_id: FromPath[str],
        data: JSONBody[ThresholdTuning],
        cache_admin: NamedDependency[CacheAdmin],
        entry: NamedDependency[AuditRecord],
    ) -> ThresholdTuned:
        """Choose and set the tenant's similarity threshold from its own labelled question pairs
        (`a` cached, `b` asked, `same`): the most recall at `min_precision` (`objective:
        precision`, the default) or the best F1 (`f1`). 422 when no threshold qualifies."""
        tuned = await cache_admin.tune_threshold(tenant_id, data)
        entry.detail = {"pairs": tuned.pairs, "threshold": tuned.threshold}
        return tuned

    @post(
        "/cache/feedback",
        status_code=200,
        responses=admin_errors(400, 404),
        opt=audited_as("cache.feedback"),
    )
    async def report_wrong_hit(
        self,
        data: JSONBody[WrongHit],
        cache_admin: NamedDependency[CacheAdmin],
        entry: NamedDependency[AuditRecord],
    ) -> WrongHitOut:
        """Report a wrong cached response by its tenant and its `id` (`chatcmpl-…`, in the body
        and every chunk of a stream), or its `x-request-id` when the client sent none (a
        client's own is echoed there, and names nothing here): the entry it came from is
        invalidated (the next identical request misses) and counted. 404 for a request that
        tenant has no cached response on record for, including another tenant's."""
        entry.target = data.tenant
        entry.detail = {"request_id": data.request_id}
        await cache_admin.report_wrong_hit(data.tenant, data.request_id)
        return WrongHitOut(invalidated=True)
