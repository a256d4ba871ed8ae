"""The admission scripts may be run twice for one request — a retry after a lost reply — and
reserve and settle it once."""

from __future__ import annotations

from datetime import UTC, datetime

from redis.asyncio import Redis

from loramux.gateway.quotas.buckets import WINDOW_MS, plan, release_mark
from loramux.gateway.quotas.config import PrincipalLimits, ScopeLimits
from loramux.gateway.quotas.readings import ADMITTED, ADMITTED_BEFORE
from loramux.gateway.quotas.scripts import ADMIT, SETTLE
from tests.gateway.quotas.rig import QuotaRig


async def test_a_repeated_admission_or_settlement_counts_once(rig: QuotaRig) -> None:
    redis = rig.service().redis
    p = await rig.principal()
    limits = ScopeLimits(rpm=10, tpm=1000, max_concurrent=2, token_budget=5000, budget_period="day")
    now = rig.clock()
    buckets = plan(p.tenant_id, p.key_id, PrincipalLimits(limits, ScopeLimits()), _at(now))
    keys = [k for b in buckets for k in b.keys] + [release_mark(p.tenant_id, "req-1")]
    args: list[int | str] = [int(now * 1000), "req-1", 300, WINDOW_MS, 30_000]
    for b in buckets:
        args += [b.kind, b.a, b.b, 0]
    admit, settle = redis.register_script(ADMIT), redis.register_script(SETTLE)
    assert (await admit(keys=keys, args=args))[0] == ADMITTED
    assert (await admit(keys=keys, args=args))[0] == ADMITTED_BEFORE
    await _assert_counts(redis, keys, requests=1, tokens=300, slots=1, spent=300)
    for _ in range(2):
        await settle(keys=keys, args=["req-1", 120, 0, *(b.kind for b in buckets)])
    await _assert_counts(redis, keys, requests=1, tokens=120, slots=0, spent=120)


async def _assert_counts(
    redis: Redis, keys: list[str], *, requests: int, tokens: int, slots: int, spent: int
) -> None:
    win, _, wsum, conc, ledger, _ = keys
    assert await redis.zcard(win) == requests
    assert int(await redis.get(wsum)) == tokens
    assert await redis.zcard(conc) == slots
    assert int(await redis.hget(ledger, "spent")) == spent


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)
