"""Requests and tokens per minute over a sliding 60-second window, concurrent requests as leased
slots, and tenant and key limits checked together: all or nothing."""

from __future__ import annotations

import asyncio

from loramux.gateway.db import Quota
from loramux.gateway.errors import InsufficientQuota, RateLimited
from tests.gateway.quotas.rig import QuotaRig, refusal, remaining_tokens


async def test_requests_per_minute_slide_over_the_last_60_seconds(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"rpm": 3})
    await svc.admit(p, 10, 10)
    rig.clock.advance(20)
    for _ in range(2):
        await svc.admit(p, 10, 10)
    err = await refusal(svc.admit(p, 10, 10))
    assert isinstance(err, RateLimited)
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.limit_type == "requests"
    # the first request leaves the window 40 s from now; the window is whole in 60 s
    assert err.headers["retry-after"] == "40"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.headers["x-ratelimit-reset-requests"] == "1m0s"
    rig.clock.advance(39.5)
    err = await refusal(svc.admit(p, 10, 10))
    assert err.headers["retry-after"] == "1"  # 0.5 s, rounded up
    rig.clock.advance(0.5)
    admitted = await svc.admit(p, 10, 10)
    assert admitted.headers["x-ratelimit-remaining-requests"] == "0"
    await refusal(svc.admit(p, 10, 10))


async def test_tokens_per_minute_reserve_prompt_plus_max_tokens(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 1000})
    first = await svc.admit(p, 100, 500)
    assert first.headers == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "400",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    rig.clock.advance(15)
    err = await refusal(svc.admit(p, 100, 350))
    assert isinstance(err, RateLimited) and err.limit_type == "tokens"
    assert err.body()["error"] == {
        "message": err.message,
        "type": "tokens",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert err.headers["retry-after"] == "45"
    assert err.headers["x-ratelimit-remaining-tokens"] == "400"
    assert (await svc.admit(p, 100, 300)).headers["x-ratelimit-remaining-tokens"] == "0"


async def test_a_request_larger_than_the_limit_is_told_not_to_retry(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 1000})
    err = await refusal(svc.admit(p, 600, 401))
    assert isinstance(err, RateLimited) and err.limit_type == "tokens"
    assert "retry-after" not in err.headers and err.headers["x-should-retry"] == "false"
    assert "Request too large" in err.message
    assert await remaining_tokens(svc, p) == 1000


async def test_the_wait_for_tokens_counts_the_oldest_reservations_first(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 1000})
    for used in (300, 300, 300):
        await svc.admit(p, 0, used)
        rig.clock.advance(10)
    # 900 reserved at t=0, 10, 20; now t=30. Needing 500 means two of them must leave: at t=70.
    err = await refusal(svc.admit(p, 0, 500))
    assert err.headers["retry-after"] == "40"


async def test_concurrent_requests_hold_a_slot_until_settled(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(key={"max_concurrent": 2})
    a = await svc.admit(p, 1, 1)
    await svc.admit(p, 1, 1)
    err = await refusal(svc.admit(p, 1, 1))
    assert isinstance(err, RateLimited) and err.limit_type == "requests"
    assert "concurrent" in err.message and err.headers["retry-after"] == "1"
    assert a.headers == {}  # concurrency has no OpenAI header
    await a.settle(2)
    await svc.admit(p, 1, 1)


async def test_slots_of_a_dead_gateway_expire_with_their_lease(rig: QuotaRig) -> None:
    dead = rig.service(slot_lease_seconds=30.0)
    alive = rig.service(slot_lease_seconds=30.0)
    p = await rig.principal(tenant={"max_concurrent": 2})
    await dead.admit(p, 1, 1)  # never settled: its gateway "dies" (stops renewing)
    running = await alive.admit(p, 1, 1)
    rig.clock.advance(25)
    await alive.leases.renew_all()  # what the live gateway does every lease / 3
    rig.clock.advance(10)
    await alive.admit(p, 1, 1)  # the dead slot expired; the renewed one still holds
    await refusal(alive.admit(p, 1, 1))
    await running.settle(2)


async def test_tenant_and_key_limits_are_all_or_nothing(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(
        tenant={"tpm": 1000, "max_concurrent": 5, "token_budget": 10_000, "budget_period": "day"},
        key={"rpm": 10, "tpm": 5000, "max_concurrent": 1},
    )
    held = await svc.admit(p, 100, 100)
    assert held.headers["x-ratelimit-limit-tokens"] == "1000"  # the binding scope: the tenant's
    assert held.headers["x-ratelimit-remaining-requests"] == "9"
    # refused by the key's concurrency: nothing is reserved in any other bucket
    await refusal(svc.admit(p, 100, 600))
    await held.settle(200)
    # refused by the tenant's tokens: the key's slot and requests are not taken either
    assert isinstance(await refusal(svc.admit(p, 200, 700)), RateLimited)
    probe = await svc.admit(p, 0, 0)
    assert probe.headers["x-ratelimit-remaining-requests"] == "8"
    assert probe.headers["x-ratelimit-remaining-tokens"] == "800"
    await probe.settle(0)


async def test_the_longest_wait_decides_the_type_and_retry_after(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"rpm": 2, "tpm": 100})
    await svc.admit(p, 0, 50)
    rig.clock.advance(10)
    await svc.admit(p, 0, 10)
    rig.clock.advance(10)
    # requests: one admission must leave (at t=60, in 40 s); tokens: both must (in 50 s)
    err = await refusal(svc.admit(p, 0, 95))
    assert isinstance(err, RateLimited) and err.limit_type == "tokens"
    assert err.headers["retry-after"] == "50"


async def test_limits_hold_under_concurrency_within_one_process(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"rpm": 7, "tpm": 10_000})
    results = await asyncio.gather(*(svc.admit(p, 1, 1) for _ in range(50)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(results) - len(refused) == 7
    assert all(isinstance(r, RateLimited) and r.limit_type == "requests" for r in refused)


async def test_no_limits_means_no_headers_and_no_redis(rig: QuotaRig) -> None:
    svc = rig.service(redis_url="redis://127.0.0.1:1/0")  # nothing listens there
    p = await rig.principal()
    admission = await svc.admit(p, 10, 10)
    assert admission.headers == {}
    await admission.settle(20)


async def test_quota_changes_apply_after_the_config_cache_expires(rig: QuotaRig) -> None:
    svc = rig.service(config_cache_seconds=3600.0)
    p = await rig.principal()
    await svc.admit(p, 1, 1)
    async with rig.sessions() as s:
        s.add(Quota(tenant_id=p.tenant_id, key_id=None, token_budget=1, budget_period="day"))
        await s.commit()
    await svc.admit(p, 1, 1)  # the cached rows (no limits) still apply
    assert isinstance(await refusal(rig.service().admit(p, 1, 1)), InsufficientQuota)
