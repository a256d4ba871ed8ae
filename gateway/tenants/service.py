"""Tenants: names are unique; deleting one removes its keys, quotas and private adapters.

Keys and quotas go with the tenant's row (foreign keys cascade); its adapter versions are
soft-deleted and their digests retired in the engine (requests in flight finish); its response-
cache entries are purged, and a tombstone refuses any it would store later (a request in flight,
or one another process admits before it notices). Usage and audit rows stay: they are history. Disabling a tenant or deleting it drops its keys from this
process's key cache at once; other gateway processes notice within LORAMUX_KEY_CACHE_SECONDS.
A tenant's `prefix_cache_scope` (gateway.prefix_cache) lives in `Tenant.settings` and takes
effect the same way.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.cache.response_cache import ResponseCache
from loramux.gateway.adapters.service import AdapterService
from loramux.gateway.admin.paging import Paging, page_of
from loramux.gateway.admin.wire import Deleted, utc
from loramux.gateway.auth.api_keys import ApiKeyAuth
from loramux.gateway.db import ApiKey, Tenant
from loramux.gateway.errors import Conflict
from loramux.gateway.prefix_cache import SETTING as PREFIX_SCOPE
from loramux.gateway.prefix_cache import scope_of
from loramux.gateway.tenants.lookup import check_tenant_name, get_locked_tenant, get_tenant
from loramux.gateway.tenants.schemas import TenantCreate, TenantOut, TenantPage, TenantUpdate

_UNPURGED = (
    "the tenant was deleted, but the response cache did not answer: its cached responses are "
    "purged once it does (this gateway retries), else they expire unserved"
)


def tenant_out(tenant: Tenant) -> TenantOut:
    scope = scope_of(tenant.settings or {})
    return TenantOut(tenant.id, tenant.name, tenant.disabled, utc(tenant.created_at), scope)


class TenantService:
    """Tenants over one database session (one request's)."""

    def __init__(
        self,
        session: AsyncSession,
        keys: ApiKeyAuth,
        adapters: AdapterService,
        response_cache: ResponseCache,
    ) -> None:
        self.session = session
        self.keys = keys
        self.adapters = adapters
        self.response_cache = response_cache

    async def create(self, body: TenantCreate) -> TenantOut:
        check_tenant_name(body.name)
        await _ensure_name_free(self.session, body.name)
        settings = {PREFIX_SCOPE: body.prefix_cache_scope}
        tenant = Tenant(name=body.name, disabled=False, settings=settings)
        self.session.add(tenant)
        await _commit_unique(self.session, body.name)
        return tenant_out(tenant)

    async def list_page(self, paging: Paging) -> TenantPage:
        query = select(Tenant).order_by(Tenant.created_at, Tenant.id)
        if (matches := paging.name_filter(Tenant.name)) is not None:
            query = query.where(matches)
        rows, total = await page_of(self.session, query, paging)
        return TenantPage([tenant_out(t) for t in rows], total, paging.limit, paging.offset)

    async def get(self, ref: str) -> TenantOut:
        return tenant_out(await get_tenant(self.session, ref))

    async def update(self, ref: str, body: TenantUpdate) -> TenantOut:
        if isinstance(body.name, str):
            check_tenant_name(body.name)
        # Locked: a delete under way either commits first (404 here) or waits for this commit.
        tenant = await get_locked_tenant(self.session, ref)
        if isinstance(body.name, str) and body.name != tenant.name:
            await _ensure_name_free(self.session, body.name)
            tenant.name = body.name
        if isinstance(body.disabled, bool):
            tenant.disabled = body.disabled
        if isinstance(body.prefix_cache_scope, str):
            # A new dict: the JSON column only notices reassignment.
            tenant.settings = dict(tenant.settings or {}) | {PREFIX_SCOPE: body.prefix_cache_scope}
        await _commit_unique(self.session, tenant.name)
        for key_id in await _key_ids(self.session, tenant.id):
            self.keys.forget(key_id)
        return tenant_out(tenant)

    async def delete(self, ref: str) -> Deleted:
        # Locked before its adapters are read: a publish under way either commits first, and
        # its version is soft-deleted here, or finds the tenant gone (adapters.service); a
        # delete that committed first makes this one a 404.
        tenant = await get_locked_tenant(self.session, ref)
        tenant_id = tenant.id
        key_ids = await _key_ids(self.session, tenant_id)
        versions, digests = await self.adapters.soft_delete_owned_by(tenant_id)
        await self.session.delete(tenant)
        await self.session.commit()
        for key_id in key_ids:
            self.keys.forget(key_id)
        await self.adapters.retire_unused(digests)
        self.adapters.catalog.invalidate()
        # A tombstone: a request in flight, or one another process still admits for a moment
        # (its key cache), can store nothing of this tenant after its purge. The delete has
        # committed: a cache Redis that fails leaves the purge to a retry (cache.purge).
        detail = {"keys": len(key_ids), "adapter_versions": versions}
        purged = await self.response_cache.deleted_tenants.purge(tenant_id)
        if purged is None:
            return Deleted(tenant_id, detail=detail, note=_UNPURGED)
        return Deleted(tenant_id, detail=detail | {"cache_entries": purged})


async def _key_ids(session: AsyncSession, tenant_id: str) -> list[str]:
    return list(await session.scalars(select(ApiKey.id).where(ApiKey.tenant_id == tenant_id)))


async def _ensure_name_free(session: AsyncSession, name: str) -> None:
    if await session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise _name_taken(name)


async def _commit_unique(session: AsyncSession, name: str) -> None:
    """Commit; a concurrent writer that took the name first makes this a 409 too."""
    try:
        await session.commit()
    except IntegrityError:
        await session.rollback()
        raise _name_taken(name) from None


def _name_taken(name: str) -> Conflict:
    return Conflict(f"a tenant named {name!r} already exists", param="name", code="name_taken")
