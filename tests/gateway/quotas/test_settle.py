"""A reservation is settled exactly once, against the real usage: the window then counts what
the request really used, and its concurrency slot is free."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from redis.asyncio import Redis

from loramux.gateway.quotas.buckets import budget_period, scope_prefix
from tests.gateway.quotas.rig import QuotaRig, refusal, remaining_tokens
from tests.gateway.servers import TcpRelay
from tests.redis import RedisServer


async def test_remaining_tokens_after_settling_equal_the_limit_minus_real_usage(
    rig: QuotaRig,
) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 10_000}, key={"tpm": 20_000})
    admissions = [await svc.admit(p, 100, 1000) for _ in range(5)]
    assert await remaining_tokens(svc, p) == 10_000 - 5 * 1100
    used = [0, 150, 600, 1100, 1]
    for admission, tokens in zip(admissions, used, strict=True):
        await admission.settle(tokens)
    assert await remaining_tokens(svc, p) == 10_000 - sum(used)


async def test_only_the_first_settle_counts(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 1000, "max_concurrent": 1})
    admission = await svc.admit(p, 100, 400)
    await asyncio.gather(admission.settle(300), admission.settle(0), admission.settle(500))
    await admission.settle(1)
    assert admission.settled
    assert await remaining_tokens(svc, p) == 700
    held = await svc.admit(p, 0, 0)  # one slot, free again, released only once
    await refusal(svc.admit(p, 0, 0))
    await held.settle(0)


async def test_a_request_that_left_the_window_settles_nothing_into_it(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 1000})
    admission = await svc.admit(p, 0, 500)
    rig.clock.advance(60)
    await admission.settle(400)
    assert await remaining_tokens(svc, p) == 1000


async def test_a_cancelled_caller_still_settles(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 1000, "max_concurrent": 1})
    admission = await svc.admit(p, 0, 500)
    settling = asyncio.ensure_future(admission.settle(120))
    await asyncio.sleep(0)  # the settle has begun: a client disconnect cancels its caller now
    settling.cancel()
    await asyncio.gather(settling, return_exceptions=True)
    await svc.close()  # waits for settlements under way
    assert await remaining_tokens(svc, p) == 880


async def test_usage_above_the_reservation_is_charged_in_full(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 1000})
    await (await svc.admit(p, 10, 10)).settle(30)
    assert await remaining_tokens(svc, p) == 970


async def test_a_caller_cancelled_while_its_admission_is_in_flight_leaves_no_reservation(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    """A client that leaves during admission cancels its caller after the script was sent: Redis
    still runs it, and what it reserved is released (settled with 0) all the same."""
    relay = TcpRelay(own_redis.port)
    try:
        svc = rig.service(relay.redis_url)
        limits = {"tpm": 100_000, "max_concurrent": 5, "token_budget": 100_000}
        p = await rig.principal(tenant=limits | {"budget_period": "day"})
        await (await svc.admit(p, 10, 10)).settle(20)  # the ledger exists, 20 tokens spent
        own_redis.pause()  # a slow Redis: the script reaches it, its reply waits
        try:
            sent = len(relay.seen)
            admitting = asyncio.create_task(svc.admit(p, 1000, 9000))
            await asyncio.to_thread(relay.wait_seen, b"EVALSHA", sent)
            while not admitting.done():  # the client goes away
                admitting.cancel()
                # Python 3.11's asyncio.wait_for (redis-py's send) loses a cancellation that
                # lands as its write completes; the caller then waits for the reply.
                await asyncio.wait({admitting}, timeout=0.5)
            with pytest.raises(asyncio.CancelledError):
                await admitting
        finally:
            own_redis.resume()
        await svc.close()  # waits for settlements under way
    finally:
        relay.close()
    check = Redis.from_url(own_redis.url)
    try:
        day = budget_period("day", datetime.fromtimestamp(rig.clock(), UTC))
        scope = scope_prefix(p.tenant_id, None)
        ledger = await check.hgetall(f"{scope}:budget:{day.name}")
        slots = await check.zcard(f"{scope}:conc")
        window = int(await check.get(f"{scope}:wsum") or 0)
    finally:
        await check.aclose()
    assert (ledger, slots, window) == ({b"spent": b"20"}, 0, 20)
