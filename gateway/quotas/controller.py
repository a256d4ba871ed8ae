"""Routes: quotas of a tenant (`/admin/tenants/{tenant}/quotas`, by
the tenant's id or name) or a key (`/admin/keys/{id}/quotas`)."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get, put
from litestar.di import NamedDependency
from litestar.openapi.spec import Example
from litestar.params import Body, FromPath

from loramux.gateway.admin.wire import given
from loramux.gateway.api_docs import admin_errors
from loramux.gateway.audit.action import audited_as
from loramux.gateway.audit.service import AuditRecord
from loramux.gateway.quotas.limits import QuotaLimits
from loramux.gateway.quotas.schemas import QuotaOut, QuotaUpdate

_QUOTA_EXAMPLE = Example(
    summary="Limit the rate and budget, lift the concurrency limit",
    value={
        "rpm": 600,
        "tpm": 200000,
        "max_concurrent": None,
        "token_budget": 5000000,
        "budget_period": "month",
    },
)
Quotas = Annotated[QuotaUpdate, Body(examples=[_QUOTA_EXAMPLE])]

_BODY = """Body: any of `rpm`, `tpm`, `max_concurrent`, `token_budget` (positive integers) and
`budget_period` (`day` or `month`); a field left out keeps its limit, `null` removes it."""


class QuotaController(Controller):
    path = "/"
    tags = ("admin: quotas",)

    @put(
        "/tenants/{tenant:str}/quotas",
        description=_BODY,
        responses=admin_errors(400, 404),
        opt=audited_as("quota.tenant.set", "{tenant}"),
    )
    async def set_tenant_quotas(
        self,
        tenant: FromPath[str],
        data: Quotas,
        quotas: NamedDependency[QuotaLimits],
        entry: NamedDependency[AuditRecord],
    ) -> QuotaOut:
        entry.detail = given(data)
        return await quotas.set_for_tenant(tenant, data)

    @get("/tenants/{tenant:str}/quotas", responses=admin_errors(400, 404))
    async def get_tenant_quotas(
        self, tenant: FromPath[str], quotas: NamedDependency[QuotaLimits]
    ) -> QuotaOut:
        return await quotas.get_for_tenant(tenant)

    @put(
        "/keys/{key_id:str}/quotas",
        description=_BODY,
        responses=admin_errors(400, 404),
        opt=audited_as("quota.key.set", "{key_id}"),
    )
    async def set_key_quotas(
        self,
        key_id: FromPath[str],
        data: Quotas,
        quotas: NamedDependency[QuotaLimits],
        entry: NamedDependency[AuditRecord],
    ) -> QuotaOut:
        entry.detail = given(data)
        return await quotas.set_for_key(key_id, data)

    @get("/keys/{key_id:str}/quotas", responses=admin_errors(400, 404))
    async def get_key_quotas(
        self, key_id: FromPath[str], quotas: NamedDependency[QuotaLimits]
    ) -> QuotaOut:
        return await quotas.get_for_key(key_id)
