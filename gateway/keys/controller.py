"""Routes: tenant API keys (`/admin/tenants/{id}/keys`, `/admin/keys/{id}`)."""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from gateway.api_docs import admin_errors
from gateway.audit.action import audited_as
from gateway.audit.service import AuditRecord
from gateway.keys.schemas import KeyCreate, KeyOut, NewKeyOut
from gateway.keys.service import KeyService


class KeyController(Controller):
    path = "/"
    tags = ("admin: keys",)

    @post(
        "/tenants/{tenant_id:str}/keys",
        responses=admin_errors(400, 404),
        opt=audited_as("key.create"),
    )
    async def create_key(
        self,
        tenant_id: FromPath[str],
        keys: NamedDependency[KeyService],
        entry: NamedDependency[AuditRecord],
        data: JSONBody[KeyCreate | None] = None,
    ) -> NewKeyOut:
        """Issue a key (the body is optional). The answer's `key` is shown once."""
        entry.detail = {"tenant_id": tenant_id}
        key = await keys.create(tenant_id, data or KeyCreate())
        entry.target = key.id
        return key

    @get("/tenants/{tenant_id:str}/keys", responses=admin_errors(400, 404))
    async def list_keys(
        self, tenant_id: FromPath[str], keys: NamedDependency[KeyService]
    ) -> list[KeyOut]:
        """Every key of the tenant (no secrets), revoked and expired ones included."""
        return await keys.list_for_tenant(tenant_id)

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
