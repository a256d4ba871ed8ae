"""When Redis cannot be reached, admission does what LORAMUX_QUOTA_ON_REDIS_DOWN says — `reject`
(503 quota_unavailable) or `allow` (admitted unchecked, counted) — and never limits per process;
once Redis is back, limits apply again, and the settlements it could not take are made."""

from __future__ import annotations

import asyncio
import logging
import socket
from datetime import UTC, datetime

import pytest
from redis._parsers.base import BaseParser
from redis.asyncio import Redis

from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.errors import InsufficientQuota, ServiceUnavailable
from loramux.gateway.quotas.buckets import budget_period, scope_prefix
from loramux.gateway.quotas.unsettled import refused_for_good
from tests.gateway.quotas.rig import QuotaRig, refusal
from tests.gateway.servers import TcpRelay
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


async def day_ledger(rig: QuotaRig, server: RedisServer, p: Principal) -> dict[bytes, bytes]:
    """The tenant's budget ledger of the clock's day, read straight from the server."""
    day = budget_period("day", datetime.fromtimestamp(rig.clock(), UTC))
    check = Redis.from_url(server.url)
    try:
        return dict(await check.hgetall(f"{scope_prefix(p.tenant_id, None)}:budget:{day.name}"))
    finally:
        await check.aclose()


BUDGET = {"token_budget": 10_000, "budget_period": "day"}


async def test_a_settlement_lost_to_a_network_failure_is_made_once_redis_answers(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    """Redis keeps its data through a network failure; the settlement it missed is tried again
    until it answers, so the ledger charges what was used, not the whole reservation."""
    relay = TcpRelay(own_redis.port)
    try:
        svc = rig.service(relay.redis_url, redis_timeout_ms=1000)
        p = await rig.principal(tenant=BUDGET)
        admission = await svc.admit(p, 100, 8000)  # reserves 8,100 of 10,000
        relay.block()
        await admission.settle(150)
        assert svc.redis_down["unsettled"] == 1 and len(svc.unsettled) == 1
        relay.unblock()
        await svc.unsettled.settled()
        assert await day_ledger(rig, own_redis, p) == {b"spent": b"150"}
        await (await svc.admit(p, 0, 5000)).settle(0)
    finally:
        relay.close()


async def test_closing_tries_the_settlements_waiting_for_redis_once_more(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    relay = TcpRelay(own_redis.port)
    try:
        svc = rig.service(relay.redis_url, redis_timeout_ms=1000)
        p = await rig.principal(tenant=BUDGET)
        admission = await svc.admit(p, 100, 8000)
        relay.block()
        await admission.settle(150)
        relay.unblock()
        await svc.close()
        assert await day_ledger(rig, own_redis, p) == {b"spent": b"150"}
        assert svc.redis_down["dropped"] == 0
    finally:
        relay.close()


async def test_past_its_bound_the_oldest_waiting_settlement_is_dropped_and_counted(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    relay = TcpRelay(own_redis.port)
    try:
        svc = rig.service(relay.redis_url, redis_timeout_ms=1000, max_unsettled=1)
        p = await rig.principal(tenant=BUDGET)
        first, second = await svc.admit(p, 0, 1000), await svc.admit(p, 0, 2000)
        relay.block()
        await first.settle(10)
        await second.settle(20)
        assert (len(svc.unsettled), svc.redis_down["dropped"]) == (1, 1)
        relay.unblock()
        await svc.unsettled.settled()
        ledger = await day_ledger(rig, own_redis, p)
    finally:
        relay.close()
    # The first request's reservation stays charged; the second is charged what it used.
    assert int(ledger.pop(b"spent")) == 1000 + 20 and list(ledger.values()) == [b"1000"]


class Refusing:
    """Makes a Redis refuse writes for a while, as it does on its own: `READONLY` (a primary
    demoted, as in a failover, replicating from a server that is not there) or `OOM`."""

    def __init__(self, server: RedisServer, code: str):
        self.redis = Redis.from_url(server.url)
        self.code = code

    async def start(self) -> None:
        if self.code == "READONLY":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                nobody = s.getsockname()[1]
            await self.redis.execute_command("REPLICAOF", "127.0.0.1", nobody)
        else:
            await self.redis.config_set("maxmemory", 1)

    async def stop(self) -> None:
        if self.code == "READONLY":
            await self.redis.execute_command("REPLICAOF", "NO", "ONE")
        else:
            await self.redis.config_set("maxmemory", 0)
        await self.redis.aclose()

    async def refusals(self) -> int:
        """How many commands Redis refused with the code so far."""
        stats = await self.redis.info("errorstats")
        return int(stats.get(f"errorstat_{self.code}", {}).get("count", 0))

    async def until_refused(self, count: int) -> None:
        while await self.refusals() < count:
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("code", ["READONLY", "OOM"])
async def test_a_settlement_redis_refuses_for_a_while_is_made_once_it_takes_writes(
    rig: QuotaRig, own_redis: RedisServer, code: str
) -> None:
    """Refusals Redis stops making on its own keep their settlements waiting: none is dropped,
    and the ledger charges what was used, not the reservations."""
    svc = rig.service(own_redis.url, redis_timeout_ms=1000)
    p = await rig.principal(tenant=BUDGET | {"tpm": 100_000})
    admissions = [await svc.admit(p, 0, 100) for _ in range(20)]
    refusing = Refusing(own_redis, code)
    await refusing.start()
    try:
        for a in admissions:
            await a.settle(10)
        assert len(svc.unsettled) == 20
        # every settlement refused once, then two rounds of retries refused
        await asyncio.wait_for(refusing.until_refused(20 + 2), 10)
    finally:
        await refusing.stop()
    await svc.unsettled.settled()
    assert svc.redis_down["dropped"] == 0
    assert await day_ledger(rig, own_redis, p) == {b"spent": b"200"}


async def test_settlements_redis_refuses_for_good_are_dropped_and_logged_once(
    rig: QuotaRig, own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal no retry can change (here WRONGTYPE: the ledger's key holds a string) drops the
    settlement; a burst of them is one ERROR line, with its count."""
    svc = rig.service(own_redis.url, redis_timeout_ms=1000)
    p = await rig.principal(tenant=BUDGET)
    admissions = [await svc.admit(p, 0, 100) for _ in range(20)]
    day = budget_period("day", datetime.fromtimestamp(rig.clock(), UTC))
    direct = Redis.from_url(own_redis.url)
    try:
        await direct.set(f"{scope_prefix(p.tenant_id, None)}:budget:{day.name}", "not a hash")
    finally:
        await direct.aclose()
    caplog.set_level(logging.ERROR, logger="loramux.gateway.quotas.unsettled")
    for a in admissions:
        await a.settle(10)
    await svc.unsettled.settled()
    assert svc.redis_down["dropped"] == 20
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and "WRONGTYPE" in lines[0], lines


@pytest.mark.parametrize(
    ("reply", "for_good"),
    [
        ("ERR user_script:12: attempt to compare nil with number script: 1f2e", True),
        ("ERR wrong number of arguments for 'evalsha' command", True),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", True),
        ("READONLY You can't write against a read only replica. script: 1f2e", False),
        ("OOM command not allowed when used memory > 'maxmemory'.", False),
        ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable", False),
        ("BUSY Redis is busy running a script.", False),
        ("NOSCRIPT No matching script.", False),
        ("TRYAGAIN Multiple keys request during rehashing of slot", False),
        ("NOREPLICAS Not enough good replicas to write.", False),
        # Redis 6 wraps the error of a command a script called in an ERR
        ("ERR Error running script (call to f_1f2e): @user_script:27: -OOM command not", False),
    ],
)
def test_only_a_refusal_no_retry_can_change_drops_a_settlement(reply: str, for_good: bool) -> None:
    assert refused_for_good(BaseParser.parse_error(reply)) is for_good


async def test_slot_renewal_gives_up_on_a_redis_that_stopped_answering(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    """A Redis that keeps its connections open and answers nothing (paused here, as a host
    gone silent would) holds a renewal only for the Redis timeout: the renewal fails, and the
    next one, on a fresh connection, renews the slots once Redis answers again."""
    svc = rig.service(own_redis.url, redis_timeout_ms=300)
    p = await rig.principal(tenant={"max_concurrent": 1})
    admission = await svc.admit(p, 1, 1)
    own_redis.pause()
    try:
        renewal = asyncio.ensure_future(svc.leases.renew_all())
        # far past the Redis timeout: only a renewal that waits on Redis for ever is still going
        done, _ = await asyncio.wait({renewal}, timeout=5)
        assert renewal in done, "renewing slots waited on a silent Redis past the Redis timeout"
        assert isinstance(renewal.exception(), TimeoutError)
    finally:
        renewal.cancel()
        own_redis.resume()
    await svc.leases.renew_all()
    await admission.settle(1)
