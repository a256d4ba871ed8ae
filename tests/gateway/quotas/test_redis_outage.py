"""When Redis cannot be reached, admission does what LORAMUX_QUOTA_ON_REDIS_DOWN says — `reject`
(503 quota_unavailable) or `allow` (admitted unchecked, counted) — and never limits per process;
once Redis is back, limits apply again."""

from __future__ import annotations

import socket

from loramux.gateway.errors import InsufficientQuota, ServiceUnavailable
from tests.gateway.quotas.rig import QuotaRig, refusal
from tests.redis import RedisServer

LIMITED = {"rpm": 2, "token_budget": 1000, "budget_period": "day"}


async def test_reject_answers_503_quota_unavailable(rig: QuotaRig, own_redis: RedisServer) -> None:
    svc = rig.service(own_redis.url, on_redis_down="reject", redis_timeout_ms=300)
    p = await rig.principal(tenant=LIMITED)
    await svc.admit(p, 1, 1)
    own_redis.stop()
    err = await refusal(svc.admit(p, 1, 1))
    assert isinstance(err, ServiceUnavailable) and err.status == 503
    assert err.code == "quota_unavailable" and err.body()["error"]["type"] == "server_error"
    assert err.headers["retry-after"] == "1"
    assert svc.redis_down["refused"] == 1
    unlimited = await rig.principal()
    assert (await svc.admit(unlimited, 1, 1)).headers == {}  # no limits: Redis is not needed


async def test_allow_admits_unchecked_without_headers_and_counts(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    svc = rig.service(own_redis.url, on_redis_down="allow", redis_timeout_ms=300)
    p = await rig.principal(tenant=LIMITED)
    own_redis.stop()
    for _ in range(3):  # more than rpm: nothing limits them, not even per process
        admission = await svc.admit(p, 1, 1)
        assert admission.headers == {}
        await admission.settle(2)
    assert svc.redis_down["unchecked"] == 3


async def test_a_settle_that_cannot_reach_redis_does_not_raise(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    svc = rig.service(own_redis.url, redis_timeout_ms=300)
    p = await rig.principal(tenant={"max_concurrent": 1})
    admission = await svc.admit(p, 1, 1)
    own_redis.stop()
    await admission.settle(2)
    assert svc.redis_down["unsettled"] == 1


async def test_after_a_restart_limits_apply_again_and_budgets_come_back_from_sql(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    svc = rig.service(own_redis.url)
    p = await rig.principal(tenant=LIMITED)
    await rig.add_usage(p, p.key_id, 700)
    await (await svc.admit(p, 0, 100)).settle(100)  # 800 of the day's budget spent
    own_redis.restart()  # every key is lost
    first = await svc.admit(p, 0, 100)
    assert first.headers["x-ratelimit-remaining-requests"] == "1"  # a fresh window
    await first.settle(100)
    # the ledger restarted from the 700 tokens of usage events in SQL (the 100 settled before
    # the restart have no usage event in this test), plus the 100 settled since
    assert isinstance(await refusal(svc.admit(p, 0, 201)), InsufficientQuota)
    await svc.admit(p, 0, 200)


async def test_a_redis_that_does_not_answer_counts_as_down(rig: QuotaRig) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts connections, never answers
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        svc = rig.service(url, on_redis_down="reject", redis_timeout_ms=200)
        p = await rig.principal(tenant=LIMITED)
        assert isinstance(await refusal(svc.admit(p, 1, 1)), ServiceUnavailable)
