"""Routes: a tenant's response-cache settings (`/admin/tenants/{id}/cache`) and purges
(`DELETE /admin/cache?tenant=…[&adapter=…]`)."""

from __future__ import annotations

from typing import Annotated, Literal

from litestar import Controller, delete, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from msgspec import UNSET, Meta, Struct, UnsetType

from gateway.admin import cache_service
from gateway.admin.schemas import AnyRequest, decode_body, given
from gateway.audit import audited
from gateway.auth.admin_jwt import AdminIdentity
from gateway.cache_policy import MAX_TTL, TenantCacheSettings
from gateway.state import GatewayState

Threshold = Annotated[float, Meta(ge=0.5, le=1.0)]
Ttl = Annotated[int, Meta(ge=1, le=MAX_TTL)]


class CacheSettingsUpdate(Struct, forbid_unknown_fields=True):
    """Absent fields keep their value."""

    enabled: bool | UnsetType = UNSET
    semantic: bool | UnsetType = UNSET
    threshold: Threshold | UnsetType = UNSET
    verifier: Literal["strict", "off"] | UnsetType = UNSET
    ttl: Ttl | UnsetType = UNSET
    cache_sampled: bool | UnsetType = UNSET


class CacheSettingsOut(Struct):
    tenant_id: str
    enabled: bool
    semantic: bool
    threshold: float
    verifier: str
    ttl: int
    cache_sampled: bool


class Purged(Struct):
    purged: int
    """Cached responses removed."""


def _out(tenant_id: str, settings: TenantCacheSettings) -> CacheSettingsOut:
    return CacheSettingsOut(tenant_id=tenant_id, **settings.as_dict())


_BODY = """Body: any of `enabled`, `semantic`, `cache_sampled` (booleans), `threshold` (0.5 to
1.0), `verifier` (`strict` or `off`), `ttl` (seconds, 1 to 604800); absent fields keep their
value. Semantic hits need `semantic: true` here; they are never served to sampled requests."""


class CacheController(Controller):
    path = "/"
    tags = ("admin: cache",)

    @put("/tenants/{tenant_id:str}/cache", description=_BODY)
    async def set_cache_settings(
        self,
        tenant_id: FromPath[str],
        request: AnyRequest,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> CacheSettingsOut:
        async with audited(gw, admin_identity.subject, "cache.settings.set", tenant_id) as entry:
            body = await decode_body(request, CacheSettingsUpdate)
            entry.detail = given(body)
            settings = await cache_service.update_settings(gw, tenant_id, given(body))
        return _out(tenant_id, settings)

    @get("/tenants/{tenant_id:str}/cache")
    async def get_cache_settings(
        self,
        tenant_id: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> CacheSettingsOut:
        return _out(tenant_id, await cache_service.get_settings(gw, tenant_id))

    @delete("/cache", status_code=200)
    async def purge_cache(
        self,
        tenant: FromQuery[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
        adapter: FromQuery[str | None] = None,
    ) -> Purged:
        """Remove a tenant's cached responses, or only those of one adapter: `owner/name` (every
        version), a name (the tenant's own, else shared), a digest, or `base`."""
        async with audited(gw, admin_identity.subject, "cache.purge", tenant) as entry:
            entry.detail = {"adapter": adapter}
            purged = await cache_service.purge(gw, tenant, adapter)
            entry.detail["purged"] = purged
        return Purged(purged)
