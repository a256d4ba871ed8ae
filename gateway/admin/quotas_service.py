"""Quotas of a tenant, or of one of its keys: stored here, enforced by the admission path.

An update changes only the limits it names: an absent field leaves its limit as it was, `null`
removes it. A token budget needs a period (`day` or `month`) to be counted over; an update that
would leave a budget without one is refused and changes nothing.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.admin.keys_service import get_key
from gateway.admin.schemas import QuotaOut, QuotaUpdate, given
from gateway.admin.tenants_service import get_tenant
from gateway.db import Quota
from gateway.errors import BadRequest
from gateway.state import GatewayState

LIMITS = ("rpm", "tpm", "max_concurrent", "token_budget", "budget_period")


def quota_out(tenant_id: str, key_id: str | None, quota: Quota | None) -> QuotaOut:
    values = {name: getattr(quota, name) if quota is not None else None for name in LIMITS}
    return QuotaOut(tenant_id=tenant_id, key_id=key_id, **values)


async def get_for_tenant(gw: GatewayState, tenant_id: str) -> QuotaOut:
    async with gw.sessions() as session:
        await get_tenant(session, tenant_id)
        return quota_out(tenant_id, None, await _find(session, tenant_id, None))


async def get_for_key(gw: GatewayState, key_id: str) -> QuotaOut:
    async with gw.sessions() as session:
        key = await get_key(session, key_id)
        return quota_out(key.tenant_id, key_id, await _find(session, key.tenant_id, key_id))


async def set_for_tenant(gw: GatewayState, tenant_id: str, body: QuotaUpdate) -> QuotaOut:
    async with gw.sessions() as session:
        await get_tenant(session, tenant_id)
        return await _apply(session, tenant_id, None, body)


async def set_for_key(gw: GatewayState, key_id: str, body: QuotaUpdate) -> QuotaOut:
    async with gw.sessions() as session:
        key = await get_key(session, key_id)
        return await _apply(session, key.tenant_id, key_id, body)


async def _apply(
    session: AsyncSession, tenant_id: str, key_id: str | None, body: QuotaUpdate
) -> QuotaOut:
    quota = await _find(session, tenant_id, key_id)
    if quota is None:
        quota = Quota(tenant_id=tenant_id, key_id=key_id)
        session.add(quota)
    for name, value in given(body).items():
        setattr(quota, name, value)
    if quota.token_budget is not None and quota.budget_period is None:
        raise BadRequest(
            "a token_budget needs a budget_period ('day' or 'month')",
            param="budget_period",
            code="invalid_request",
        )
    await session.commit()
    return quota_out(tenant_id, key_id, quota)


async def _find(session: AsyncSession, tenant_id: str, key_id: str | None) -> Quota | None:
    key_match = Quota.key_id.is_(None) if key_id is None else Quota.key_id == key_id
    return await session.scalar(
        select(Quota).where(Quota.tenant_id == tenant_id, key_match).limit(1)
    )
