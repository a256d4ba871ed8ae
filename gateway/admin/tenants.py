"""Routes: tenants (`/admin/tenants`)."""

from __future__ import annotations

from litestar import Controller, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.admin import tenants_service
from gateway.admin.schemas import (
    AnyRequest,
    Deleted,
    TenantCreate,
    TenantOut,
    TenantUpdate,
    decode_body,
    given,
)
from gateway.audit import audited
from gateway.auth.admin_jwt import AdminIdentity
from gateway.state import GatewayState


class TenantController(Controller):
    path = "/tenants"
    tags = ("admin: tenants",)

    @post()
    async def create_tenant(
        self,
        request: AnyRequest,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> TenantOut:
        """Create a tenant. Body: `{"name": str}` (unique: 409 when taken), optionally
        `"prefix_cache_scope": "tenant" | "shared"` (default `tenant`)."""
        async with audited(gw, admin_identity.subject, "tenant.create") as entry:
            body = await decode_body(request, TenantCreate)
            entry.detail = {"name": body.name}
            tenant = await tenants_service.create(gw, body)
            entry.target = tenant.id
        return tenant

    @get()
    async def list_tenants(
        self, gw: NamedDependency[GatewayState], admin_identity: NamedDependency[AdminIdentity]
    ) -> list[TenantOut]:
        return await tenants_service.list_all(gw)

    @get("/{tenant_id:str}")
    async def get_tenant(
        self,
        tenant_id: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> TenantOut:
        return await tenants_service.get(gw, tenant_id)

    @patch("/{tenant_id:str}")
    async def update_tenant(
        self,
        tenant_id: FromPath[str],
        request: AnyRequest,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> TenantOut:
        """Rename or disable a tenant, or set its prefix-cache scope. Body: any of
        `{"name": str, "disabled": bool, "prefix_cache_scope": "tenant" | "shared"}`; a disabled
        tenant's keys stop working (at once in this process)."""
        async with audited(gw, admin_identity.subject, "tenant.update", tenant_id) as entry:
            body = await decode_body(request, TenantUpdate)
            entry.detail = given(body)
            return await tenants_service.update(gw, tenant_id, body)

    @delete("/{tenant_id:str}", status_code=200)
    async def delete_tenant(
        self,
        tenant_id: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> Deleted:
        """Delete a tenant with its keys and quotas; its private adapters are deleted and
        retired (requests in flight finish)."""
        async with audited(gw, admin_identity.subject, "tenant.delete", tenant_id) as entry:
            deleted = await tenants_service.delete(gw, tenant_id)
            entry.detail = deleted.detail
            return deleted
