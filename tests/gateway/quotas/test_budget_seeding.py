"""Budget ledgers seeded while requests end: a request ending while its ledger is seeded is
counted (twice at worst, never not at all), and a ledger losing its total while another is
seeded is seeded in turn (gateway.quotas.ledger)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.errors import ServiceUnavailable
from loramux.gateway.quotas.buckets import budget_period, scope_prefix
from loramux.gateway.quotas.schemas import QuotaUpdate
from loramux.gateway.usage import UsageRecorder
from tests.gateway.quotas.rig import Clock, QuotaRig, refusal
from tests.gateway.quotas.test_budgets import assert_budget_left, set_quota, usage
from tests.migrations.test_revisions import new_postgres_database


@pytest.fixture
async def pg_rig(redis_url: str, postgres_url: str) -> AsyncIterator[tuple[QuotaRig, str]]:
    """A rig on a PostgreSQL database of the test's own, and its URL."""
    url = await asyncio.to_thread(new_postgres_database, postgres_url)
    await asyncio.to_thread(upgrade, url)
    engine = create_engine(url)
    rig = QuotaRig(redis_url, session_factory(engine), Clock(), [])
    try:
        yield rig, url
    finally:
        for svc in rig.services:
            await svc.close()
            await svc.redis.aclose()
        await engine.dispose()


@contextlib.asynccontextmanager
async def usage_events_locked(url: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Every read of `usage_events` in the PostgreSQL database of `url` waits until the block
    ends; yields a function that returns once one waits."""
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    lock, watch = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    waiting = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query ILIKE '%usage_events%'"
    )

    async def a_read_waits() -> None:
        async with asyncio.timeout(60):  # a read that never came would fail, not hang
            while not await watch.fetchval(waiting):
                await asyncio.sleep(0.01)

    try:
        async with lock.transaction():
            await lock.execute("LOCK TABLE usage_events IN ACCESS EXCLUSIVE MODE")
            yield a_read_waits
    finally:
        await lock.close()
        await watch.close()


async def test_a_request_ending_while_its_ledger_is_seeded_is_still_counted(
    pg_rig: tuple[QuotaRig, str],
) -> None:
    """A budget set again is seeded by the next admission from the recorder's totals, then SQL.
    A request holding a reservation in that ledger ends while SQL is being read: its event is
    recorded after the totals were read, is not in SQL, and its settlement charges nothing to a
    ledger without a total. It was counted nowhere (found by attacking the budgets)."""
    rig, url = pg_rig
    recorder = UsageRecorder(rig.sessions)  # its events wait unwritten, as for 0.5 s normally
    svc = rig.service(usage=recorder)
    monthly = {"token_budget": 1000, "budget_period": "month"}
    p = await rig.principal(tenant=monthly)
    now = datetime.fromtimestamp(rig.clock(), UTC)
    running = await svc.admit(p, 0, 800)
    await set_quota(rig, svc, p, None, QuotaUpdate(token_budget=None))
    await set_quota(rig, svc, p, None, QuotaUpdate(**monthly))  # the next admission seeds it

    async with usage_events_locked(url) as a_read_waits:  # the seed's read of SQL waits
        admitting = asyncio.create_task(svc.admit(p, 0, 100))
        await a_read_waits()
        recorder.record(usage(p, 0, 800, now, running.admitted_at, "req_running"))
        await running.settle(800)  # as the gateway ends a request: recorded, then settled
    await (await admitting).settle(100)
    await assert_budget_left(svc, p, 100)  # 900 of 1000 spent


async def test_a_ledger_losing_its_total_while_another_is_seeded_is_seeded_too(
    pg_rig: tuple[QuotaRig, str],
) -> None:
    """An admission finds the key's ledger without a total and seeds it; meanwhile the tenant's
    ledger, which had its total, loses it (its budget set again). The seeded admission then
    finds that one missing: it is seeded in turn, not a failed assertion (a 500)."""
    rig, url = pg_rig
    svc = rig.service()
    monthly = {"token_budget": 1000, "budget_period": "month"}
    p = await rig.principal(tenant=monthly, key=monthly)
    await (await svc.admit(p, 0, 300)).settle(300)
    await rig.add_usage(p, p.key_id, 300)
    await set_quota(rig, svc, p, p.key_id, QuotaUpdate(token_budget=None))
    await set_quota(rig, svc, p, p.key_id, QuotaUpdate(**monthly))

    async with usage_events_locked(url) as a_read_waits:
        admitting = asyncio.create_task(svc.admit(p, 0, 100))
        await a_read_waits()  # the key's ledger is being seeded
        await set_quota(rig, svc, p, None, QuotaUpdate(token_budget=None))
        await set_quota(rig, svc, p, None, QuotaUpdate(**monthly))
    await (await admitting).settle(100)
    await rig.add_usage(p, p.key_id, 100)
    await assert_budget_left(svc, p, 600)


async def test_concurrent_admissions_sharing_a_seed_charge_a_late_event_once(rig: QuotaRig) -> None:
    """Redis lost its data; three requests arrive together and share one seed (SingleFlight).
    A request admitted before the loss ends while their seeded scripts are on their way: its
    800 tokens are charged by the admission whose seed set the total alone (twice at worst),
    not once per admission sharing the seed (found by attacking the budgets)."""
    recorder = UsageRecorder(rig.sessions)  # unwritten, as for its 0.5 s normally
    svc = rig.service(usage=recorder)
    budget = {"token_budget": 10_000, "budget_period": "month"}
    p = await rig.principal(tenant=budget)
    now = datetime.fromtimestamp(rig.clock(), UTC)
    running = await svc.admit(p, 0, 800)
    month = budget_period("month", now)
    await svc.redis.delete(f"{scope_prefix(p.tenant_id, None)}:budget:{month.name}")  # lost

    concurrent = 3
    unseeded: list[int] = []
    seeded: list[int] = []
    all_missed, all_replied = asyncio.Event(), asyncio.Event()
    original = svc._run_admit

    async def run_admit(r, seeds):  # type: ignore[no-untyped-def]
        reply = await original(r, seeds)
        if not seeds:  # all three miss the ledger before any seed is read
            unseeded.append(1)
            if len(unseeded) == concurrent:
                all_missed.set()
            await all_missed.wait()
        else:  # the running request ends while the seeded scripts are on their way
            seeded.append(1)
            if len(seeded) == concurrent:
                recorder.record(usage(p, 0, 800, now, running.admitted_at, "req_running"))
                await running.settle(800)  # its reservation was lost with the ledger
                all_replied.set()
            await all_replied.wait()
        return reply

    svc._run_admit = run_admit  # type: ignore[method-assign]
    admissions = await asyncio.gather(*(svc.admit(p, 0, 100) for _ in range(concurrent)))
    svc._run_admit = original  # type: ignore[method-assign]
    for a in admissions:
        await a.settle(0)
    # 800 spent of 10,000 (counted twice at worst: 1,600)
    spent = int(
        await svc.redis.hget(f"{scope_prefix(p.tenant_id, None)}:budget:{month.name}", "spent")
    )
    assert spent in (800, 1600), spent
    await assert_budget_left(svc, p, 10_000 - spent)


@pytest.mark.parametrize("second_read", ["made", "failed"])
async def test_an_event_recorded_while_a_first_round_seed_was_on_its_way_counts_in_a_second_round(
    rig: QuotaRig, tmp_path: Path, second_read: str
) -> None:
    """SEED_ROUNDS: round 1 seeds the key's ledger (its budget set again); while that script is
    on its way a request holding a reservation there ends (recorded, then settled into the
    ledger without a total: nothing charged), and the tenant's budget is set again, so round 2
    seeds the tenant's ledger. The late charge of the key's ledger counts from round 1's seed,
    the one that set its total, not round 2's (which counts the event already): counted once,
    and so too when round 2's read of SQL fails (503) (found by attacking the budgets)."""
    recorder = UsageRecorder(rig.sessions)
    svc = rig.service(usage=recorder)
    monthly = {"token_budget": 10_000, "budget_period": "month"}
    p = await rig.principal(tenant=monthly, key=monthly)
    now = datetime.fromtimestamp(rig.clock(), UTC)
    month = budget_period("month", now)
    key_ledger = f"{scope_prefix(p.tenant_id, p.key_id)}:budget:{month.name}"
    running = await svc.admit(p, 0, 800)
    await set_quota(rig, svc, p, p.key_id, QuotaUpdate(token_budget=None))
    await set_quota(rig, svc, p, p.key_id, QuotaUpdate(**monthly))  # the key's is seeded anew

    original = svc._run_admit
    rounds: list[dict[int, int]] = []

    async def run_admit(r, seeds):  # type: ignore[no-untyped-def]
        if seeds:
            rounds.append(dict(seeds))
        if len(rounds) == 1 and seeds:  # round 1's script is on its way
            recorder.record(usage(p, 0, 800, now, running.admitted_at, "req_running"))
            await running.settle(800)
            await set_quota(rig, svc, p, None, QuotaUpdate(token_budget=None))
            await set_quota(rig, svc, p, None, QuotaUpdate(**monthly))
            if second_read == "failed":  # the database went away
                svc.sessions = session_factory(create_engine(f"sqlite:///{tmp_path}/gone/x.db"))
        return await original(r, seeds)

    svc._run_admit = run_admit  # type: ignore[method-assign]
    if second_read == "failed":
        assert isinstance(await refusal(svc.admit(p, 0, 100)), ServiceUnavailable)
    else:
        await (await svc.admit(p, 0, 100)).settle(0)
        assert len(rounds) == 2, rounds  # the second round happened
    svc._run_admit = original  # type: ignore[method-assign]
    assert int(await svc.redis.hget(key_ledger, "spent")) == 800  # the 800 counted, once


@pytest.mark.parametrize("lost", ["client left", "no answer"])
async def test_a_seed_whose_reply_never_came_still_charges_what_was_recorded(
    rig: QuotaRig, lost: str
) -> None:
    """The seeded script reaches Redis (Redis still runs it: the ledger gets its total), but
    its reply never comes: the client left (cancelled), or Redis answered too late (503). A
    request that ended while the script was on its way (its reservation lost with Redis's data)
    is still charged, once: after the release, in its task (found by attacking the budgets)."""
    recorder = UsageRecorder(rig.sessions)
    svc = rig.service(usage=recorder)
    budget = {"token_budget": 10_000, "budget_period": "month"}
    p = await rig.principal(tenant=budget)
    now = datetime.fromtimestamp(rig.clock(), UTC)
    running = await svc.admit(p, 0, 800)
    month = budget_period("month", now)
    ledger = f"{scope_prefix(p.tenant_id, None)}:budget:{month.name}"
    await svc.redis.delete(ledger)  # Redis lost its data

    original = svc._run_admit

    async def run_admit(r, seeds):  # type: ignore[no-untyped-def]
        if not seeds:
            return await original(r, seeds)
        recorder.record(usage(p, 0, 800, now, running.admitted_at, "req_running"))
        await running.settle(800)  # the lost ledger: nothing to settle
        reply = await original(r, seeds)  # the script ran in Redis
        if lost == "no answer":
            raise TimeoutError
        asyncio.current_task().cancel()  # type: ignore[union-attr]  # the client left
        await asyncio.sleep(0)
        return reply

    svc._run_admit = run_admit  # type: ignore[method-assign]
    task = asyncio.create_task(svc.admit(p, 0, 100))
    with contextlib.suppress(asyncio.CancelledError, ServiceUnavailable):
        await task
    svc._run_admit = original  # type: ignore[method-assign]
    assert task.cancelled() == (lost == "client left")
    await svc.close()  # waits for the release under way, and what follows it
    assert int(await svc.redis.hget(ledger, "spent")) == 800  # the ended request, once
