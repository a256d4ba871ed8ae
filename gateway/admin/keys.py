"""Routes: tenant API keys (`/admin/tenants/{id}/keys`, `/admin/keys/{id}`)."""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.admin import keys_service
from gateway.admin.schemas import AnyRequest, KeyCreate, KeyOut, NewKeyOut, decode_body
from gateway.audit import audited
from gateway.auth.admin_jwt import AdminIdentity
from gateway.state import GatewayState


class KeyController(Controller):
    path = "/"
    tags = ("admin: keys",)

    @post("/tenants/{tenant_id:str}/keys")
    async def create_key(
        self,
        tenant_id: FromPath[str],
        request: AnyRequest,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> NewKeyOut:
        """Issue a key. Optional body: `name`, `expires_at` (ISO time) or `expires_in`
        (seconds), `allowed_models` (list of model names). The answer's `key` is shown once."""
        async with audited(gw, admin_identity.subject, "key.create") as entry:
            entry.detail = {"tenant_id": tenant_id}
            key = await keys_service.create(gw, tenant_id, await decode_body(request, KeyCreate))
            entry.target = key.id
        return key

    @get("/tenants/{tenant_id:str}/keys")
    async def list_keys(
        self,
        tenant_id: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> list[KeyOut]:
        """Every key of the tenant (no secrets), revoked and expired ones included."""
        return await keys_service.list_for_tenant(gw, tenant_id)

    @delete("/keys/{key_id:str}", status_code=200)
    async def revoke_key(
        self,
        key_id: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> KeyOut:
        """Revoke a key: refused at once by this process, by others within the key cache TTL."""
        async with audited(gw, admin_identity.subject, "key.revoke", key_id):
            return await keys_service.revoke(gw, key_id)
