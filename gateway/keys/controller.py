"""Routes: tenant API keys (`/admin/tenants/{tenant}/keys` by the tenant's id or name,
`/admin/keys/{id}`)."""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from loramux.gateway.admin.paging import Paging
from loramux.gateway.api_docs import admin_errors
from loramux.gateway.audit.action import audited_as
from loramux.gateway.audit.service import AuditRecord
from loramux.gateway.keys.schemas import KeyCreate, KeyOut, KeyPage, NewKeyOut
from loramux.gateway.keys.service import KeyService


class KeyController(Controller):
    path = "/"
    tags = ("admin: keys",)

    @post(
        "/tenants/{tenant:str}/keys",
        responses=admin_errors(400, 404),
        opt=audited_as("key.create"),
    )
    async def create_key(
        self,
        tenant: FromPath[str],
        keys: NamedDependency[KeyService],
        entry: NamedDependency[AuditRecord],
        data: JSONBody[KeyCreate | None] = None,
    ) -> NewKeyOut:
        """Issue a key (the body is optional). The answer's `key` is shown once."""
        entry.detail = {"tenant": tenant}  # as given: a refused create is audited with it too
        key = await keys.create(tenant, data or KeyCreate())
        entry.detail = {"tenant_id": key.tenant_id}
        entry.target = key.id
        return key

    @get("/tenants/{tenant:str}/keys", responses=admin_errors(400, 404))
    async def list_keys(
        self,
        tenant: FromPath[str],
        keys: NamedDependency[KeyService],
        paging: NamedDependency[Paging],
    ) -> KeyPage:
        """The tenant's keys (no secrets), revoked and expired ones included, oldest first, a
        page at a time; `name` keeps those whose name holds it."""
        return await keys.list_for_tenant(tenant, paging)

    @delete(
        "/keys/{key_id:str}",
        status_code=200,
        responses=admin_errors(400, 404),
        opt=audited_as("key.revoke", "{key_id}"),
    )
    async def revoke_key(
        self,
        key_id: FromPath[str],
        keys: NamedDependency[KeyService],
        entry: NamedDependency[AuditRecord],
    ) -> KeyOut:
        """Revoke a key: refused at once by this process, by others within the key cache TTL."""
        return await keys.revoke(key_id)
