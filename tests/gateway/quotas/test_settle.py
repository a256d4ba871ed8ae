"""A reservation is settled exactly once, against the real usage: the window then counts what
the request really used, and its concurrency slot is free."""

from __future__ import annotations

import asyncio

from tests.gateway.quotas.rig import QuotaRig, refusal, remaining_tokens


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
