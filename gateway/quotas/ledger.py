"""The starting value of a token-budget ledger, read from the usage events in SQL and this
process's usage events not yet written there.

A ledger (`<scope>:budget:<period>` in Redis) is created by the first admission that needs it:
at the start of each period, which is why budgets need no reset job, or after Redis lost its
data. It starts from the billable tokens the usage events of that scope and period already
record, so a Redis restart does not hand tenants a fresh budget. An event counts in the period
its request was admitted in (`admitted_at`), the one whose ledger its reservation was charged
to, even when it finished in the next: a request spanning a period boundary is charged once.

Events wait in their gateway process's UsageRecorder until written (a fraction of a second, or
as long as the database cannot take writes); this process's waiting events are counted too,
from the recorder's running totals (gateway.usage.unwritten), each once.

A request still running when its ledger is seeded counts through its reservation, which the
seed's script adds (gateway.quotas.scripts); one that ends before, through its event. One that
ends while the seed is read or on its way to Redis fell between the two: its event was recorded
after the totals were read (and is not in SQL either), and its settlement removed its
reservation from a ledger without a total, charging nothing there. So a seed is a `Seed`: what
was read, plus the tokens recorded since the read (`UnwrittenTokens.recorded`), taken when its
script is sent; those recorded while it was on its way are charged once its reply came (even
when a later round then failed: 503), or, when none came (the caller left, Redis did not answer
in time), after the admission's release (`QuotaService._charge_recorded_late`): by the one
admission whose seed set the total, from what that seed counted (admissions sharing a read each
send it, and an admission seeding in rounds sends it anew each round; the ledger's `seeded`
field names the one Redis took, and the charge takes it away). A request ending in those
windows may count twice (its event added, and its settlement charged too if it reached Redis
after the seed), never not at all, unless Redis cannot be reached for the late charge (logged).

What this cannot see: requests still running when Redis lost its data, and the events other
gateway processes have not written yet (no process can read another's buffer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db import UsageEvent
from loramux.gateway.quotas.buckets import BudgetPeriod
from loramux.gateway.usage import UsageRecorder

ATTEMPTS = 3
"""Reads of SQL before a write of the scope's events that overlaps every one is let be."""


@dataclass(frozen=True)
class Seed:
    """A ledger's starting value as read, and how to add what was recorded after the read."""

    read: int
    """Tokens in SQL and in the recorder's totals, as `spent_in_period` read them."""
    recorded: Callable[[], int]
    """Tokens of the scope and period the recorder has taken so far (never decreases)."""
    recorded_at_read: int
    """`recorded()` when the totals were read."""

    def now(self) -> int:
        """The seed to send: what was read, plus what was recorded since."""
        return self.read + self.recorded() - self.recorded_at_read


async def spent_in_period(
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    key_id: str | None,
    period: BudgetPeriod,
    usage: UsageRecorder | None = None,
) -> Seed:
    """Prompt plus completion tokens of the scope's usage events admitted in `period` (a key's
    alone when `key_id` is given; cache hits record 0 billable tokens): those in SQL, plus those
    still waiting in `usage`, this process's recorder, each counted once.

    The waiting events are counted from the recorder's running totals (O(1) in the size of its
    buffer: gateway.usage.unwritten), then SQL is read. An event leaves the totals only once
    its write committed, so one that left them before they were read is in SQL, and one counted
    there is not in SQL unless its write committed while SQL was being read. Matching the
    waiting events against SQL by request id would catch that, but needs their ids (the buffer
    scan this avoids) and matched only so many of them; instead the read is trusted only when
    no write holding the tenant's events was under way from before the totals were read to
    after SQL answered (`UnwrittenTokens.writes`). Otherwise it waits for the write under way
    and reads again, up to ATTEMPTS times; the last reading counts, so an event of a write that
    overlapped every read may count twice (one write's worth at most), never not at all.
    Events recorded after the totals were read are added by `Seed.now`."""
    if usage is None:
        return Seed(await _in_sql(sessions, tenant_id, key_id, period), lambda: 0, 0)
    unwritten = usage.unwritten
    scope = (tenant_id, key_id, period.start, period.end)
    for _ in range(ATTEMPTS):
        await unwritten.between_writes()
        writes = unwritten.writes(tenant_id)
        waiting, recorded = unwritten.total(*scope), unwritten.recorded(*scope)
        in_sql = await _in_sql(sessions, tenant_id, key_id, period)
        if writes % 2 == 0 and unwritten.writes(tenant_id) == writes:
            break
    return Seed(in_sql + waiting, lambda: unwritten.recorded(*scope), recorded)


async def _in_sql(
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    key_id: str | None,
    period: BudgetPeriod,
) -> int:
    """Billable tokens of the scope's usage events in SQL admitted in `period`."""
    tokens = UsageEvent.prompt_tokens + UsageEvent.completion_tokens
    admitted = func.coalesce(UsageEvent.admitted_at, UsageEvent.created_at)
    query = select(func.coalesce(func.sum(tokens), 0)).where(
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
        return int((await session.execute(query)).scalar_one())
