"""Routes: tenants (`/admin/tenants`). `{tenant}` is a tenant's id or its name."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.openapi.spec import Example
from litestar.params import Body, FromPath, JSONBody

from loramux.gateway.admin.paging import Paging
from loramux.gateway.admin.wire import Deleted, given
from loramux.gateway.api_docs import admin_errors
from loramux.gateway.audit.action import audited_as
from loramux.gateway.audit.service import AuditRecord
from loramux.gateway.tenants.schemas import TenantCreate, TenantOut, TenantPage, TenantUpdate
from loramux.gateway.tenants.service import TenantService

_CREATE_EXAMPLE = Example(
    summary="A tenant whose prompts may share the prefix cache",
    value={"name": "acme-support", "prefix_cache_scope": "shared"},
)


class TenantController(Controller):
    path = "/tenants"
    tags = ("admin: tenants",)

    @post(responses=admin_errors(400, 409), opt=audited_as("tenant.create"))
    async def create_tenant(
        self,
        data: Annotated[TenantCreate, Body(examples=[_CREATE_EXAMPLE])],
        tenants: NamedDependency[TenantService],
        entry: NamedDependency[AuditRecord],
    ) -> TenantOut:
        """Create a tenant; its name is unique (409 when taken)."""
        entry.detail = {"name": data.name}
        tenant = await tenants.create(data)
        entry.target = tenant.id
        return tenant

    @get(responses=admin_errors(400))
    async def list_tenants(
        self, tenants: NamedDependency[TenantService], paging: NamedDependency[Paging]
    ) -> TenantPage:
        """Tenants, oldest first, a page at a time; `name` keeps those whose name holds it."""
        return await tenants.list_page(paging)

    @get("/{tenant:str}", responses=admin_errors(400, 404))
    async def get_tenant(
        self, tenant: FromPath[str], tenants: NamedDependency[TenantService]
    ) -> TenantOut:
        return await tenants.get(tenant)

    @patch(
        "/{tenant:str}",
        responses=admin_errors(400, 404, 409),
        opt=audited_as("tenant.update", "{tenant}"),
    )
    async def update_tenant(
        self,
        tenant: FromPath[str],
        data: JSONBody[TenantUpdate],
        tenants: NamedDependency[TenantService],
        entry: NamedDependency[AuditRecord],
    ) -> TenantOut:
        """Rename or disable a tenant, or set its prefix-cache scope."""
        entry.detail = given(data)
        updated = await tenants.update(tenant, data)
        entry.target = updated.id
        return updated

    @delete(
        "/{tenant:str}",
        status_code=200,
        responses=admin_errors(400, 404),
        opt=audited_as("tenant.delete", "{tenant}"),
    )
    async def delete_tenant(
        self,
        tenant: FromPath[str],
        tenants: NamedDependency[TenantService],
        entry: NamedDependency[AuditRecord],
    ) -> Deleted:
        """Delete a tenant with its keys and quotas; its private adapters are deleted and
        retired (requests in flight finish) and its cached responses purged (`note` says when
        the response cache did not answer: the purge is then retried)."""
        deleted = await tenants.delete(tenant)
        entry.target = deleted.id
        entry.detail = dict(deleted.detail)
        if deleted.note is not None:
            entry.detail["note"] = deleted.note
        return deleted
