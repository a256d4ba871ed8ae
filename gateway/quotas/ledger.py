"""The starting value of a token-budget ledger, read from the usage events in SQL.

A ledger (`<scope>:budget:<period>` in Redis) is created by the first admission that needs it:
at the start of each period, which is why budgets need no reset job, or after Redis lost its
data. It starts from the billable tokens the usage events of that scope and period already
record, so a Redis restart does not hand tenants a fresh budget. An event counts in the period
its request was admitted in (`admitted_at`), the one whose ledger its reservation was charged
to, even when it finished in the next: a request spanning a period boundary is charged once.
What this cannot see: requests still running when Redis lost its data, and usage events not yet
flushed to SQL (a fraction of a second).
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db import UsageEvent
from loramux.gateway.quotas.buckets import BudgetPeriod


async def spent_in_period(
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    key_id: str | None,
    period: BudgetPeriod,
) -> int:
    """Prompt plus completion tokens of the scope's usage events admitted in `period` (a key's
    alone when `key_id` is given; cache hits record 0 billable tokens)."""
    spent = func.coalesce(func.sum(UsageEvent.prompt_tokens + UsageEvent.completion_tokens), 0)
    admitted = func.coalesce(UsageEvent.admitted_at, UsageEvent.created_at)
    query = select(spent).where(
        UsageEvent.tenant_id == tenant_id,
        # Implied by the next condition (a request finishes after its admission); lets the
        # database narrow the scan with the index on created_at.
        UsageEvent.created_at >= period.start,
        admitted >= period.start,
        admitted < period.end,
    )
    if key_id is not None:
        query = query.where(UsageEvent.key_id == key_id)
    async with sessions() as session:
        return int(await session.scalar(query) or 0)
