"""Threads that serve tenants in turn (engine.fair_pool: the gateway's tokenizer threads, the
engine's grammar compiles): one owner's backlog does not hold up another owner's next job, a
job whose caller left is never run, and errors reach the caller. Real threads; the one thread
is held busy with an event so that jobs queue up."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from loramux.engine.fair_pool import Backlogged, FairPool


@pytest.fixture
async def pool() -> AsyncIterator[FairPool]:
    pool = FairPool(1, "test-fair")
    yield pool
    pool.close()


async def _hold(pool: FairPool) -> tuple[threading.Event, asyncio.Future[None]]:
    """The pool's thread busy until the event is set."""
    started, release = threading.Event(), threading.Event()

    def busy() -> None:
        started.set()
        release.wait(30)

    held = pool.run("holder", busy)
    assert await asyncio.to_thread(started.wait, 30)
    return release, held


async def test_a_second_owners_job_runs_after_one_job_of_an_owner_with_a_backlog(
    pool: FairPool,
) -> None:
    release, held = await _hold(pool)
    ran: list[str] = []
    jobs = [pool.run("a", ran.append, f"a{i}") for i in range(5)]
    jobs.append(pool.run("b", ran.append, "b0"))
    assert pool.waiting() == 6
    release.set()
    await asyncio.gather(held, *jobs)
    assert ran == ["a0", "b0", "a1", "a2", "a3", "a4"]  # one queue: b0 last


async def test_owners_take_turns_job_by_job(pool: FairPool) -> None:
    release, held = await _hold(pool)
    ran: list[str] = []
    jobs = [pool.run(owner, ran.append, f"{owner}{i}") for owner in "abc" for i in range(2)]
    release.set()
    await asyncio.gather(held, *jobs)
    assert ran == ["a0", "b0", "c0", "a1", "b1", "c1"]


async def test_a_job_whose_caller_stopped_waiting_is_not_run(pool: FairPool) -> None:
    release, held = await _hold(pool)
    ran: list[str] = []
    left = pool.run("a", ran.append, "left")
    left.cancel()
    kept = pool.run("a", ran.append, "kept")
    release.set()
    await asyncio.gather(held, kept)
    assert ran == ["kept"]
    assert pool.waiting() == 0


async def test_an_error_reaches_its_caller_and_the_thread_goes_on(pool: FairPool) -> None:
    def fail() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await pool.run("a", fail)
    assert await pool.run("a", lambda: 7) == 7


async def test_closing_cancels_the_jobs_not_started_and_refuses_new_ones() -> None:
    pool = FairPool(1, "test-fair-close")
    release, held = await _hold(pool)
    waiting = pool.run("a", lambda: None)
    pool.close()
    release.set()
    await held  # the running job ends
    with pytest.raises(asyncio.CancelledError):
        await waiting
    with pytest.raises(RuntimeError, match="closed"):
        pool.run("a", lambda: None)


async def test_an_owner_at_its_bound_of_waiting_jobs_is_refused_another_others_are_not() -> None:
    pool = FairPool(1, "test-fair-bound", max_waiting=2)
    try:
        release, held = await _hold(pool)
        waiting = [pool.run("a", lambda: "a") for _ in range(2)]
        with pytest.raises(Backlogged):
            pool.run("a", lambda: "a")
        other = pool.run("b", lambda: "b")
        release.set()
        assert await asyncio.gather(held, *waiting, other) == [None, "a", "a", "b"]
        assert await pool.run("a", lambda: "a") == "a"  # room again once they started
    finally:
        pool.close()


async def test_jobs_whose_callers_left_count_neither_as_waiting_nor_against_the_bound() -> None:
    pool = FairPool(1, "test-fair-left", max_waiting=2)
    try:
        release, held = await _hold(pool)
        for _ in range(2):
            pool.run("a", lambda: "left").cancel()
        assert pool.waiting() == 0
        kept = [pool.run("a", lambda: "kept") for _ in range(2)]
        assert pool.waiting() == 2
        release.set()
        assert await asyncio.gather(*kept) == ["kept", "kept"]
        await held
    finally:
        pool.close()


async def test_a_job_raising_stop_iteration_fails_its_caller_instead_of_hanging(
    pool: FairPool,
) -> None:
    def stop() -> None:
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration"):
        await asyncio.wait_for(pool.run("a", stop), 30)


async def test_abandoned_jobs_leave_their_queue_so_a_cancel_storm_stays_within_the_bound() -> None:
    """A tenant whose clients connect and leave before their prompts' turn (a cancel storm,
    another tenant's long prompt on the only thread) holds at most its bound of jobs: a
    cancelled job leaves its queue, at once when its owner's next job finds the queue full, or
    when its done-callback runs. It used to stay until its turn, growing the queue without
    bound, every `run` of that owner scanning it all under the pool's lock."""
    bound = 4
    pool = FairPool(1, "test-fair-storm", max_waiting=bound)
    try:
        release, held = await _hold(pool)
        for _ in range(100 * bound):  # cancelled before their callbacks could run
            pool.run("flooder", lambda: None).cancel()
            assert len(pool._queues.get("flooder", ())) <= bound
        left = [pool.run("flooder", lambda: None) for _ in range(bound - 1)]
        for future in left:
            future.cancel()
        await asyncio.sleep(0)  # one turn of the loop: the done-callbacks run
        assert "flooder" not in pool._queues
        kept = pool.run("flooder", lambda: "kept")
        release.set()
        assert await kept == "kept"
        await held
    finally:
        pool.close()
