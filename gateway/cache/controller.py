"""Routes: a tenant's response-cache settings (`/admin/tenants/{id}/cache`) and purges
(`DELETE /admin/cache?tenant=…[&adapter=…]`)."""

from __future__ import annotations

from litestar import Controller, delete, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody

from gateway.admin.wire import given
from gateway.api_docs import admin_errors
from gateway.audit.action import audited_as
from gateway.audit.service import AuditRecord
from gateway.cache.schemas import CacheSettingsOut, CacheSettingsUpdate, Purged
from gateway.cache.service import CacheAdmin

_BODY = """Body: any of `enabled`, `semantic`, `cache_sampled` (booleans), `threshold` (0.5 to
1.0), `verifier` (`strict` or `off`), `ttl` (seconds, 1 to 604800); absent fields keep their
value. Semantic hits need `semantic: true` here; they are never served to sampled requests."""


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
