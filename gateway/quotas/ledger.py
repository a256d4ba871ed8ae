"""The starting value of a token-budget ledger, read from the usage events in SQL and this
process's usage events not yet written there.

A ledger (`<scope>:budget:<period>` in Redis) is created by the first admission that needs it:
at the start of each period, which is why budgets need no reset job, or after Redis lost its
data. It starts from the billable tokens the usage events of that scope and period already
record, so a Redis restart does not hand tenants a fresh budget. An event counts in the period
its request was admitted in (`admitted_at`), the one whose ledger its reservation was charged
to, even when it finished in the next: a request spanning a period boundary is charged once.

Events wait in their gateway process's UsageRecorder until written (a fraction of a second, or
as long as the database cannot take writes); this process's waiting events are counted too.
What this cannot see: requests still running when Redis lost its data, and the events other
gateway processes have not written yet (no process can read another's buffer).
"""

from __future__ import annotations

from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db import UsageEvent
from loramux.gateway.quotas.buckets import BudgetPeriod
from loramux.gateway.usage import UsageRecorder

MATCHED_AT_MOST = 5000
"""Waiting events looked for in SQL by request id, oldest first (a bound parameter each)."""


async def spent_in_period(
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    key_id: str | None,
    period: BudgetPeriod,
    usage: UsageRecorder | None = None,
) -> int:
    """Prompt plus completion tokens of the scope's usage events admitted in `period` (a key's
    alone when `key_id` is given; cache hits record 0 billable tokens): those in SQL, plus those
    still waiting in `usage`, this process's recorder, each counted once.

    The buffer is read first, then SQL, in one statement that also sums the waiting events it
    already holds, matched by request id (the gateway's own random id). An event leaves the
    buffer only once its write committed, so one gone from the buffer when it was read is in
    SQL, and one read there counts from the buffer unless the statement found it in SQL. Writes
    take the buffer's oldest first, so only the oldest MATCHED_AT_MOST are looked for: a newer
    one written before the statement ran (thousands of writes within one read) would count
    twice, never not at all."""
    waiting = usage.unwritten(tenant_id, key_id, period.start, period.end) if usage else []
    tokens = UsageEvent.prompt_tokens + UsageEvent.completion_tokens
    matched = sorted({request_id for request_id, _ in waiting[:MATCHED_AT_MOST]})
    in_buffer = case((UsageEvent.request_id.in_(matched), tokens), else_=0)
    admitted = func.coalesce(UsageEvent.admitted_at, UsageEvent.created_at)
    query = select(func.coalesce(func.sum(tokens), 0), func.coalesce(func.sum(in_buffer), 0)).where(
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
        in_sql, also_waiting = (await session.execute(query)).one()
    return int(in_sql) + sum(n for _, n in waiting) - int(also_waiting)
