"""Routes: quotas of a tenant (`/admin/tenants/{id}/quotas`) or a key (`/admin/keys/{id}/quotas`)."""

from __future__ import annotations

from litestar import Controller, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.admin import quotas_service
from gateway.admin.schemas import AnyRequest, QuotaOut, QuotaUpdate, decode_body, given
from gateway.audit import audited
from gateway.auth.admin_jwt import AdminIdentity
from gateway.state import GatewayState

_BODY = """Body: any of `rpm`, `tpm`, `max_concurrent`, `token_budget` (positive integers) and
`budget_period` (`day` or `month`); a field left out keeps its limit, `null` removes it."""


class QuotaController(Controller):
    path = "/"
    tags = ("admin: quotas",)

    @put("/tenants/{tenant_id:str}/quotas", description=_BODY)
    async def set_tenant_quotas(
        self,
        tenant_id: FromPath[str],
        request: AnyRequest,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> QuotaOut:
        async with audited(gw, admin_identity.subject, "quota.tenant.set", tenant_id) as entry:
            body = await decode_body(request, QuotaUpdate)
            entry.detail = given(body)
            return await quotas_service.set_for_tenant(gw, tenant_id, body)

    @get("/tenants/{tenant_id:str}/quotas")
    async def get_tenant_quotas(
        self,
        tenant_id: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> QuotaOut:
        return await quotas_service.get_for_tenant(gw, tenant_id)

    @put("/keys/{key_id:str}/quotas", description=_BODY)
    async def set_key_quotas(
        self,
        key_id: FromPath[str],
        request: AnyRequest,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> QuotaOut:
        async with audited(gw, admin_identity.subject, "quota.key.set", key_id) as entry:
            body = await decode_body(request, QuotaUpdate)
            entry.detail = given(body)
            return await quotas_service.set_for_key(gw, key_id, body)

    @get("/keys/{key_id:str}/quotas")
    async def get_key_quotas(
        self,
        key_id: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> QuotaOut:
        return await quotas_service.get_for_key(gw, key_id)
