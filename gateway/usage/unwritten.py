"""Running totals of the billable tokens of the usage events a UsageRecorder still holds, so a
token-budget ledger rebuilt from SQL (gateway.quotas.ledger) can count this process's events not
written yet without reading the buffer: a scan of it (250,000 events at most, by default) took
70-160 ms of the event loop, once per admission that rebuilt a ledger, even while the database
was down.

Totals are kept per tenant, key and UTC day of admission (the day the request's reservation
was charged to): a budget period is a whole number of UTC days (a day or a month), so its total
is a sum over a tenant's few keys and days, whatever the buffer holds.

A ledger's seed reads these totals, then SQL. An event leaves the totals only once its write
committed, but between that commit and its removal here it is in both; so is any event whose
write commits while SQL is being read. `writes(tenant)` says whether such a window was open:
it counts the starts and the ends of the writes that hold the tenant's billable events (odd
while one is under way), so an unchanged, even count around a read means no event of the
tenant was committed during it, and the totals and SQL then count each event exactly once.

An event recorded after the totals were read is in neither, and its request's settlement
charges nothing to a ledger still waiting for its seed. `recorded` counts every event recorded,
never taken back: a seed adds what was recorded from its read until its script is sent, so
such an event counts too (twice, should it be written before SQL answers, or settle after the
seed reached Redis: a seed may count twice, never not at all). These counts keep the days of
the last RECORDED_DAYS days, more than any budget period.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loramux.gateway.usage.recorder import UsageRecord

Day = tuple[str, datetime]
"""A key id and the UTC start of a day."""

RECORDED_DAYS = 62
"""Days of admission `UnwrittenTokens.recorded` keeps counts of (two months at least)."""


def admission_day(e: UsageRecord) -> datetime:
    """The UTC start of the day `e` was admitted in (when it ended, if it never was)."""
    ts = e.admitted_at or e.created_at
    ts = ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
    return ts.replace(hour=0, minute=0, second=0, microsecond=0)


class UnwrittenTokens:
    """Billable tokens (prompt plus completion) of the events waiting in one recorder."""

    def __init__(self) -> None:
        self._tokens: dict[str, Counter[Day]] = {}
        self._recorded: dict[str, Counter[Day]] = {}
        self._writes: Counter[str] = Counter()
        self._idle = asyncio.Event()
        self._idle.set()

    def add(self, e: UsageRecord) -> None:
        """Count an event that entered the buffer."""
        tokens = e.prompt_tokens + e.completion_tokens
        if not tokens:
            return
        day = (e.key_id, admission_day(e))
        self._tokens.setdefault(e.tenant_id, Counter())[day] += tokens
        recorded = self._recorded.setdefault(e.tenant_id, Counter())
        if day not in recorded:
            oldest = day[1] - timedelta(days=RECORDED_DAYS)
            for gone in [d for d in recorded if d[1] < oldest]:
                del recorded[gone]
        recorded[day] += tokens

    def remove(self, events: Iterable[UsageRecord]) -> None:
        """Stop counting events that left the buffer (written, or dropped)."""
        for e in events:
            tokens = e.prompt_tokens + e.completion_tokens
            if not tokens:
                continue
            days = self._tokens[e.tenant_id]
            day = (e.key_id, admission_day(e))
            days[day] -= tokens
            if not days[day]:
                del days[day]
                if not days:
                    del self._tokens[e.tenant_id]

    def total(self, tenant_id: str, key_id: str | None, start: datetime, end: datetime) -> int:
        """Tokens of the tenant's waiting events (of `key_id` alone when given) admitted on the
        UTC days in [start, end), whole days."""
        return _sum(self._tokens, tenant_id, key_id, start, end)

    def recorded(self, tenant_id: str, key_id: str | None, start: datetime, end: datetime) -> int:
        """Tokens of every event of the tenant (of `key_id` alone when given) admitted on the
        UTC days in [start, end) that this recorder took, written or not: it never decreases."""
        return _sum(self._recorded, tenant_id, key_id, start, end)

    def writes(self, tenant_id: str) -> int:
        """Starts plus ends of the writes holding the tenant's billable events (odd during one)."""
        return self._writes[tenant_id]

    async def between_writes(self) -> None:
        """Returns at once, or when the write under way ends."""
        await self._idle.wait()

    @contextlib.contextmanager
    def writing(self, events: list[UsageRecord]) -> Iterator[None]:
        """Around one write of `events`, including their removal once committed."""
        tenants = {e.tenant_id for e in events if e.prompt_tokens + e.completion_tokens}
        self._writes.update(tenants)
        self._idle.clear()
        try:
            yield
        finally:
            self._writes.update(tenants)
            self._idle.set()


def _sum(
    counts: dict[str, Counter[Day]],
    tenant_id: str,
    key_id: str | None,
    start: datetime,
    end: datetime,
) -> int:
    """The tenant's counts (of `key_id` alone when given) of the UTC days in [start, end)."""
    return sum(
        n
        for (key, day), n in counts.get(tenant_id, Counter()).items()
        if key_id in (None, key) and start <= day < end
    )
