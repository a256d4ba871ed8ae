"""Where a request is checked and reserved: the Redis buckets of its tenant and of its key.

Keys, all under one Redis Cluster hash tag per tenant (`{tenant_id}`) so one script may touch
them together:

    lmx:q:{T}:t           the tenant's scope;  lmx:q:{T}:k:<key id>  one key's scope
    <scope>:win           sorted set: request → admission time (ms), the last 60 s
    <scope>:wtok          hash: request → tokens it counts for in the window
    <scope>:wsum          the sum of `wtok` (tokens in the window)
    <scope>:conc          sorted set: request → lease expiry (ms) of its concurrency slot
    <scope>:budget:<P>    hash: `spent` tokens of budget period P (`2026-11` for a month,
                          `2026-11-22` for a day, UTC), and request → its reservation for
                          each request admitted but not yet settled; `seeded`: the seed
                          that set `spent`, until its admission charged what was recorded
                          while it was on its way (gateway.quotas.ledger)
    lmx:q:{T}:released:<request>
                          set (with a TTL) when an admission whose reply never came is
                          released: its script, should it reach Redis later, reserves nothing

A bucket exists only for limits that are set; a principal with no limits has no buckets and
admission does not touch Redis at all.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

from loramux.gateway.quotas.config import PrincipalLimits, ScopeLimits

WINDOW_MS = 60_000
"""Requests and tokens per minute are counted over a sliding window of this length."""

NO_LIMIT = -1

Kind = Literal["W", "C", "B"]
Scope = Literal["tenant", "key"]


@dataclass(frozen=True)
class BudgetPeriod:
    """One UTC calendar day or month: the span a token budget is counted over."""

    name: str
    start: datetime
    end: datetime

    @property
    def end_ms(self) -> int:
        return int(self.end.timestamp() * 1000)


def budget_period(period: str, now: datetime) -> BudgetPeriod:
    """The `day` or `month` period holding `now` (an aware datetime; periods are UTC)."""
    now = now.astimezone(UTC)
    if period == "day":
        start = datetime(now.year, now.month, now.day, tzinfo=UTC)
        return BudgetPeriod(start.strftime("%Y-%m-%d"), start, start + timedelta(days=1))
    if period == "month":
        start = datetime(now.year, now.month, 1, tzinfo=UTC)
        days = calendar.monthrange(now.year, now.month)[1]
        return BudgetPeriod(start.strftime("%Y-%m"), start, start + timedelta(days=days))
    raise ValueError(f"unknown budget period {period!r}")


@dataclass(frozen=True)
class Bucket:
    """One bucket as the admission script reads it: a kind, its keys and two numbers.

    - `W` rate window: keys (win, wtok, wsum); a = requests per minute, b = tokens per minute
      (NO_LIMIT for an unset one).
    - `C` concurrency: keys (conc,); a = concurrent requests; b unused.
    - `B` token budget: keys (ledger,); a = tokens per period; b = the period's end (ms since the epoch).
    """

    kind: Kind
    scope: Scope
    keys: tuple[str, ...]
    a: int
    b: int
    period: BudgetPeriod | None = None
    key_id: str | None = None
    """The key of a key-scope bucket (for reading a budget's spent tokens back from SQL)."""


def scope_prefix(tenant_id: str, key_id: str | None) -> str:
    tenant = f"lmx:q:{{{tenant_id}}}"
    return f"{tenant}:t" if key_id is None else f"{tenant}:k:{key_id}"


def release_mark(tenant_id: str, member: str) -> str:
    """The key marking request `member` of the tenant released (see gateway.quotas.scripts)."""
    return f"lmx:q:{{{tenant_id}}}:released:{member}"


def plan(tenant_id: str, key_id: str, limits: PrincipalLimits, now: datetime) -> list[Bucket]:
    """Every bucket a request must fit in, tenant scope first."""
    buckets = _scope_buckets("tenant", scope_prefix(tenant_id, None), limits.tenant, now, None)
    buckets += _scope_buckets("key", scope_prefix(tenant_id, key_id), limits.key, now, key_id)
    return buckets


def _scope_buckets(
    scope: Scope, prefix: str, limits: ScopeLimits, now: datetime, key_id: str | None
) -> list[Bucket]:
    out: list[Bucket] = []
    if limits.rpm is not None or limits.tpm is not None:
        keys = (f"{prefix}:win", f"{prefix}:wtok", f"{prefix}:wsum")
        out.append(Bucket("W", scope, keys, _limit(limits.rpm), _limit(limits.tpm)))
    if limits.max_concurrent is not None:
        out.append(Bucket("C", scope, (f"{prefix}:conc",), limits.max_concurrent, NO_LIMIT))
    if limits.token_budget is not None:
        period = budget_period(limits.budget_period or "month", now)
        ledger = f"{prefix}:budget:{period.name}"
        out.append(
            Bucket("B", scope, (ledger,), limits.token_budget, period.end_ms, period, key_id)
        )
    return out


def _limit(value: int | None) -> int:
    return NO_LIMIT if value is None else value
