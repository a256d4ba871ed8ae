"""500 concurrent requests against a limit of N, spread over two gateway processes' QuotaServices
(each on its own thread, event loop, Redis connection pool and database engine, sharing only
Redis and SQL), admit at most N; once all are settled, what remains is what the real usage
implies."""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.errors import GatewayError, InsufficientQuota, RateLimited
from loramux.gateway.quotas import Admission, QuotaService
from tests.gateway.quotas.rig import QuotaRig, redis_client, refusal, remaining_tokens, settings

REQUESTS = 500
N = 37


@dataclass(frozen=True)
class Outcome:
    reserved: list[int]
    """Tokens reserved by each admitted request."""
    used: list[int]
    """Tokens each admitted request really used (settled with)."""
    refusals: list[GatewayError]


def gateway(
    rig: QuotaRig, db_url: str, p: Principal, requests: list[tuple[int, int]], both: Any
) -> Outcome:
    """One gateway process: admits its share all at once, waits until the other has admitted
    too (so no slot frees early), then settles each admitted request with a random usage."""

    async def run() -> Outcome:
        db = create_engine(db_url)
        svc = QuotaService(redis_client(rig.redis_url), session_factory(db), settings(), rig.clock)
        both.wait()
        results = await asyncio.gather(
            *(svc.admit(p, prompt, max_tokens) for prompt, max_tokens in requests),
            return_exceptions=True,
        )
        both.wait()
        admitted = [
            (a, prompt + mx)
            for a, (prompt, mx) in zip(results, requests, strict=True)
            if isinstance(a, Admission)
        ]
        rng = random.Random(len(requests))
        used = [rng.randint(0, reserved) for _, reserved in admitted]
        await asyncio.gather(*(a.settle(u) for (a, _), u in zip(admitted, used, strict=True)))
        await svc.close()
        await svc.redis.aclose()
        await db.dispose()
        refused = [r for r in results if not isinstance(r, Admission)]
        assert all(isinstance(r, GatewayError) for r in refused), refused
        return Outcome([r for _, r in admitted], used, refused)

    return asyncio.run(run())


async def two_gateways(rig: QuotaRig, db_url: str, p: Principal) -> Outcome:
    rng = random.Random(7)
    requests = [(rng.randint(1, 50), rng.randint(1, 100)) for _ in range(REQUESTS)]
    both = threading.Barrier(2)
    a, b = await asyncio.gather(
        asyncio.to_thread(gateway, rig, db_url, p, requests[: REQUESTS // 2], both),
        asyncio.to_thread(gateway, rig, db_url, p, requests[REQUESTS // 2 :], both),
    )
    return Outcome(a.reserved + b.reserved, a.used + b.used, a.refusals + b.refusals)


@pytest.mark.parametrize(
    ("tenant", "key"),
    [
        ({"rpm": N}, None),
        (None, {"max_concurrent": N}),
        ({"rpm": 1000, "max_concurrent": N + 5}, {"rpm": N, "tpm": 100_000}),
    ],
    ids=["rpm", "concurrency", "tenant-and-key"],
)
async def test_at_most_n_requests_are_admitted(
    rig: QuotaRig, quota_db_url: str, tenant: dict | None, key: dict | None
) -> None:
    p = await rig.principal(tenant=tenant, key=key)
    outcome = await two_gateways(rig, quota_db_url, p)
    assert len(outcome.reserved) == N
    assert len(outcome.refusals) == REQUESTS - N
    assert all(isinstance(r, RateLimited) for r in outcome.refusals)


async def test_tokens_per_minute_hold_and_settle_to_the_real_usage(
    rig: QuotaRig, quota_db_url: str
) -> None:
    tpm = 2000
    p = await rig.principal(tenant={"tpm": tpm})
    outcome = await two_gateways(rig, quota_db_url, p)
    assert sum(outcome.reserved) <= tpm
    assert sum(outcome.reserved) > tpm - 150  # refused ones asked for more than was left
    assert await remaining_tokens(rig.service(), p) == tpm - sum(outcome.used)


async def test_a_token_budget_holds_and_settles_to_the_real_usage(
    rig: QuotaRig, quota_db_url: str
) -> None:
    budget = 3000
    p = await rig.principal(key={"token_budget": budget, "budget_period": "month"})
    outcome = await two_gateways(rig, quota_db_url, p)
    assert sum(outcome.reserved) <= budget
    assert all(isinstance(r, InsufficientQuota) for r in outcome.refusals)
    svc = rig.service()
    left = budget - sum(outcome.used)
    assert isinstance(await refusal(svc.admit(p, 0, left + 1)), InsufficientQuota)
    await svc.admit(p, 0, left)
