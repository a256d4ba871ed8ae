"""Quotas of a tenant, or of one of its keys: stored here, enforced by the admission path.

An update changes only the limits it names: an absent field leaves its limit as it was, `null`
removes it. A token budget needs a period (`day` or `month`) to be counted over; an update that
would leave a budget without one is refused and changes nothing. Concurrent updates of one
scope all apply, one after the other, to its single row. A write locks the tenant's row first
(`get_locked_tenant`), as the tenant's delete does: one racing that delete is a 404.

A budget set where there was none, or counted over another period, starts from what the scope
spent this period: its ledgers in Redis (`<scope>:budget:*`) lose their total, so the next
admission seeds it again from the usage events in SQL (gateway.quotas.ledger), plus the
reservations the ledger still holds. A ledger left from an earlier budget never saw what was
spent while there was none. The totals go just before the commit: no admission uses them until
the change is read (no budget, or the other period's ledger), and when Redis cannot be reached
the update is refused whole (503) and can be retried. A request still running keeps its
reservation in its ledger, so it counts until it settles (deleting the ledger whole let the
budget be exceeded by what was in flight); one that settles before the seed charges nothing
there (SETTLE), and counts in the seed once its usage is recorded.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.cache.keys import glob_escape
from loramux.gateway.admin.wire import given
from loramux.gateway.db import Quota
from loramux.gateway.errors import BadRequest, Conflict, ServiceUnavailable
from loramux.gateway.keys.service import get_key, get_locked_key
from loramux.gateway.quotas.buckets import scope_prefix
from loramux.gateway.quotas.schemas import QuotaOut, QuotaUpdate
from loramux.gateway.tenants.lookup import get_locked_tenant, get_tenant

LIMITS = ("rpm", "tpm", "max_concurrent", "token_budget", "budget_period")
_ATTEMPTS = 3


def quota_out(tenant_id: str, key_id: str | None, quota: Quota | None) -> QuotaOut:
    values = {name: getattr(quota, name) if quota is not None else None for name in LIMITS}
    return QuotaOut(tenant_id=tenant_id, key_id=key_id, **values)


class QuotaLimits:
    """The quota rows of tenants and keys, over one database session (one request's), and the
    quota Redis whose budget ledgers a restarted budget drops."""

    def __init__(self, session: AsyncSession, redis: Redis) -> None:
        self.session = session
        self.redis = redis

    async def get_for_tenant(self, ref: str) -> QuotaOut:
        """`ref`: the tenant's id or name."""
        tenant_id = (await get_tenant(self.session, ref)).id
        return quota_out(tenant_id, None, await _find(self.session, tenant_id, None))

    async def get_for_key(self, key_id: str) -> QuotaOut:
        key = await get_key(self.session, key_id)
        quota = await _find(self.session, key.tenant_id, key_id)
        return quota_out(key.tenant_id, key_id, quota)

    async def set_for_tenant(self, ref: str, body: QuotaUpdate) -> QuotaOut:
        """`ref`: the tenant's id or name."""
        tenant_id = (await get_tenant(self.session, ref)).id
        return await self._apply(tenant_id, None, body)

    async def set_for_key(self, key_id: str, body: QuotaUpdate) -> QuotaOut:
        key = await get_key(self.session, key_id)
        return await self._apply(key.tenant_id, key_id, body)

    async def _apply(self, tenant_id: str, key_id: str | None, body: QuotaUpdate) -> QuotaOut:
        """Apply the fields `body` names to the scope's row, inserting the row on its first
        write.

        Concurrent first writes race to insert it and the unique index lets one win; the others
        fail to commit, roll back, then find the winner's row on their next try and apply their
        fields on top, as if they had come after it."""
        session = self.session
        for _ in range(_ATTEMPTS):
            # Locked: a delete of the tenant either commits first (404 here) or waits for this
            # commit; the row is never written after the delete removed it or its owner.
            if key_id is None:
                await get_locked_tenant(session, tenant_id)
            else:
                await get_locked_key(session, key_id)
            quota = await _find(session, tenant_id, key_id)
            if quota is None:
                quota = Quota(tenant_id=tenant_id, key_id=key_id)
                session.add(quota)
            before = (quota.token_budget, quota.budget_period)
            for name, value in given(body).items():
                setattr(quota, name, value)
            if quota.token_budget is not None and quota.budget_period is None:
                raise BadRequest(
                    "a token_budget needs a budget_period ('day' or 'month')",
                    param="budget_period",
                    code="invalid_request",
                )
            if _budget_restarts(before, quota):
                await self._reseed_ledgers(tenant_id, key_id)
            try:
                await session.commit()
            except IntegrityError:
                await session.rollback()
                continue
            return quota_out(tenant_id, key_id, quota)
        raise Conflict("the quotas changed concurrently; retry", code="quota_conflict")

    async def _reseed_ledgers(self, tenant_id: str, key_id: str | None) -> None:
        """Take the total out of the scope's budget ledgers of every period, keeping their
        reservations: the next admission seeds it again (see the module's docstring)."""
        pattern = glob_escape(f"{scope_prefix(tenant_id, key_id)}:budget:") + "*"
        try:
            ledgers = [key async for key in self.redis.scan_iter(match=pattern, count=1000)]
            for ledger in ledgers:
                await self.redis.hdel(ledger, "spent")
        except (OSError, RedisError) as exc:
            raise ServiceUnavailable(
                f"the quota Redis is unavailable, so the budget cannot start over: {exc}",
                code="quota_unavailable",
            ) from exc


def _budget_restarts(before: tuple[int | None, str | None], quota: Quota) -> bool:
    """Whether the update set a budget where there was none, or moved it to another period."""
    budget, period = before
    return quota.token_budget is not None and (budget is None or period != quota.budget_period)


async def _find(session: AsyncSession, tenant_id: str, key_id: str | None) -> Quota | None:
    key_match = Quota.key_id.is_(None) if key_id is None else Quota.key_id == key_id
    return await session.scalar(
        select(Quota).where(Quota.tenant_id == tenant_id, key_match).limit(1)
    )
