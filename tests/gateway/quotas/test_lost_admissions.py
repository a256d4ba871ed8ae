"""An admission whose reply never came (it timed out, or its caller was cancelled) is released on
another connection; its script may reach Redis after the release, and then reserves nothing
(real redis-server, a real TCP relay whose open connections stall)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from redis.asyncio import Redis

from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.errors import ServiceUnavailable
from loramux.gateway.quotas import QuotaService
from loramux.gateway.quotas.buckets import (
    WINDOW_MS,
    budget_period,
    plan,
    release_mark,
    scope_prefix,
)
from loramux.gateway.quotas.config import PrincipalLimits, ScopeLimits
from loramux.gateway.quotas.readings import RELEASED
from loramux.gateway.quotas.scripts import ADMIT, SETTLE
from tests.gateway.quotas.relay import StallingRelay
from tests.gateway.quotas.rig import QuotaRig, refusal
from tests.redis import RedisServer

LIMITS = {"tpm": 100_000, "max_concurrent": 5, "token_budget": 10_000, "budget_period": "day"}


async def test_a_timed_out_admission_that_reaches_redis_after_its_release_reserves_nothing(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    relay = StallingRelay(own_redis.port)
    try:
        svc = rig.service(relay.redis_url, redis_timeout_ms=300)
        p = await rig.principal(tenant=LIMITS)
        await (await svc.admit(p, 0, 1)).settle(0)  # the ledger exists, one pooled connection
        relay.stall()
        err = await refusal(svc.admit(p, 100, 8000))
        assert isinstance(err, ServiceUnavailable)  # the client is told nothing was admitted
        await _after_its_release(svc, relay)
    finally:
        relay.close()
    assert await _state(rig, own_redis, p) == ({b"spent": b"0"}, 0, 0)


async def test_a_cancelled_admission_that_reaches_redis_after_its_release_reserves_nothing(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    relay = StallingRelay(own_redis.port)
    try:
        svc = rig.service(relay.redis_url)
        p = await rig.principal(tenant=LIMITS)
        await (await svc.admit(p, 0, 1)).settle(0)
        relay.stall()
        admitting = asyncio.create_task(svc.admit(p, 100, 8000))
        await asyncio.to_thread(relay.held.wait, 10)  # the script is on its way
        while not admitting.done():  # the client goes away
            admitting.cancel()
            # Python 3.11's asyncio.wait_for (redis-py's send) loses a cancellation that lands
            # as its write completes; the caller then waits for the reply.
            await asyncio.wait({admitting}, timeout=0.5)
        with pytest.raises(asyncio.CancelledError):
            await admitting
        await _after_its_release(svc, relay)
    finally:
        relay.close()
    assert await _state(rig, own_redis, p) == ({b"spent": b"0"}, 0, 0)


@pytest.mark.parametrize(
    "limits",
    [
        ScopeLimits(rpm=10, tpm=1000),
        ScopeLimits(max_concurrent=2),
        ScopeLimits(token_budget=5000, budget_period="day"),
    ],
    ids=["window", "slots", "budget"],
)
async def test_a_member_released_before_its_admission_is_reserved_nowhere(
    rig: QuotaRig, limits: ScopeLimits
) -> None:
    """Each structure the admission script reserves in: a release that came first (marking the
    member) leaves the script nothing to reserve."""
    redis = rig.service().redis
    p = await rig.principal()
    now = rig.clock()
    buckets = plan(p.tenant_id, p.key_id, PrincipalLimits(limits, ScopeLimits()), _at(now))
    keys = [k for b in buckets for k in b.keys] + [release_mark(p.tenant_id, "req-1")]
    admit, settle = redis.register_script(ADMIT), redis.register_script(SETTLE)
    await settle(keys=keys, args=["req-1", 0, 60_000, *(b.kind for b in buckets)])
    args: list[int | str] = [int(now * 1000), "req-1", 300, WINDOW_MS, 30_000]
    for b in buckets:
        args += [b.kind, b.a, b.b, 0]
    assert await admit(keys=keys, args=args) == [RELEASED]
    assert [k for k in keys[:-1] if await redis.exists(k)] == []  # nothing reserved or seeded
    assert 0 < await redis.pttl(keys[-1]) <= 60_000  # the mark expires


async def _after_its_release(svc: QuotaService, relay: StallingRelay) -> None:
    """Returns once the release of the lost admission is done, then its script has run."""
    await svc.close()  # waits for settlements under way: the release went on a new connection
    relay.let_go()
    assert await asyncio.to_thread(relay.answered.wait, 10)


async def _state(rig: QuotaRig, server: RedisServer, p: Principal) -> tuple[dict, int, int]:
    """The tenant's ledger, slots held and tokens in the window."""
    check = Redis.from_url(server.url)
    try:
        day = budget_period("day", _at(rig.clock()))
        scope = scope_prefix(p.tenant_id, None)
        ledger = await check.hgetall(f"{scope}:budget:{day.name}")
        slots = await check.zcard(f"{scope}:conc")
        window = int(await check.get(f"{scope}:wsum") or 0)
    finally:
        await check.aclose()
    return ledger, slots, window


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)
