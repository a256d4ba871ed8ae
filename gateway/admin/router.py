"""The admin router: every domain's controller behind the admin guard, and the services they
take, provided per request over one database session.

This is where the admin side's dependencies are composed from the process's state: a handler
names a service (`tenants: TenantService`) and never sees the state itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Router
from litestar.di import NamedDependency, Provide
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.gateway.adapters.controller import AdapterController
from loramux.gateway.adapters.service import AdapterService
from loramux.gateway.adapters.upload import UPLOADS_FOLDER, UploadSpace
from loramux.gateway.admin.body import AdminRequest
from loramux.gateway.admin.guard import admin_guard
from loramux.gateway.admin.paging import provide_paging
from loramux.gateway.audit.action import audit_middleware, provide_entry
from loramux.gateway.audit.controller import AuditController
from loramux.gateway.audit.service import AuditLog
from loramux.gateway.cache.controller import CacheController
from loramux.gateway.cache.service import CacheAdmin
from loramux.gateway.errors import refuse_nul
from loramux.gateway.keys.controller import KeyController
from loramux.gateway.keys.service import KeyService
from loramux.gateway.quotas.controller import QuotaController
from loramux.gateway.quotas.limits import QuotaLimits
from loramux.gateway.state import GatewayState
from loramux.gateway.tenants.controller import TenantController
from loramux.gateway.tenants.service import TenantService
from loramux.gateway.usage.controller import UsageController
from loramux.gateway.usage.service import UsageReports


def admin_router(gw: GatewayState) -> Router:
    audit_log = AuditLog(gw.sessions)
    return Router(
        "/admin",
        route_handlers=[
            TenantController,
            KeyController,
            QuotaController,
            AdapterController,
            UsageController,
            CacheController,
            AuditController,
        ],
        guards=[admin_guard(gw.admin, audit_log), refuse_nul],
        dependencies=_services(gw, audit_log),
        middleware=[audit_middleware(audit_log)],
        request_class=AdminRequest,
    )


def _services(gw: GatewayState, audit_log: AuditLog) -> dict[str, Provide]:
    """The services of the admin controllers; those holding a session get this request's."""
    usage_reports = UsageReports(gw.sessions)
    uploads = UploadSpace(
        gw.settings.data_dir / UPLOADS_FOLDER, gw.settings.server.max_upload_mb << 20
    )

    async def db_session() -> AsyncIterator[AsyncSession]:
        async with gw.sessions() as session:
            yield session

    def adapters(db_session: NamedDependency[AsyncSession]) -> AdapterService:
        return AdapterService(
            db_session, gw.store, gw.engine, gw.catalog, gw.model_name, gw.shared_store
        )

    def tenants(
        db_session: NamedDependency[AsyncSession], adapters: NamedDependency[AdapterService]
    ) -> TenantService:
        return TenantService(db_session, gw.keys, adapters, gw.cache)

    def keys(db_session: NamedDependency[AsyncSession]) -> KeyService:
        return KeyService(db_session, gw.keys)

    def quotas(db_session: NamedDependency[AsyncSession]) -> QuotaLimits:
        return QuotaLimits(db_session, gw.redis)

    def cache_admin(db_session: NamedDependency[AsyncSession]) -> CacheAdmin:
        return CacheAdmin(db_session, gw.keys, gw.cache)

    return {
        "db_session": Provide(db_session),
        "adapters": Provide(adapters, sync_to_thread=False),
        "tenants": Provide(tenants, sync_to_thread=False),
        "keys": Provide(keys, sync_to_thread=False),
        "quotas": Provide(quotas, sync_to_thread=False),
        "cache_admin": Provide(cache_admin, sync_to_thread=False),
        "audit_log": Provide(lambda: audit_log, sync_to_thread=False, use_cache=True),
        "usage_reports": Provide(lambda: usage_reports, sync_to_thread=False, use_cache=True),
        "uploads": Provide(lambda: uploads, sync_to_thread=False, use_cache=True),
        "entry": Provide(provide_entry, sync_to_thread=False),
        "paging": Provide(provide_paging),
    }
