"""Threads that serve their callers in turn: each owner's jobs (a tenant's prompts to tokenize
in the gateway, its schemas to compile in the engine: engine.async_engine) wait in a queue of
their own, and a free thread takes the next job of the next owner with work waiting, round
robin. An owner that sends many prompts at once, or huge ones, delays its own requests; every
other owner's next job waits for at most one job of each owner ahead of it.
With one queue for all, a short prompt waited behind every prompt sent before it, whoever sent
them, and a tenant refused for its rate limit (admission comes after tokenizing) still filled it.

A job whose caller stopped waiting before it started (its task was cancelled) is dropped unrun:
it leaves its owner's queue as soon as its future is cancelled (a done-callback), and a `run`
that finds its owner's queue at the bound first drops the cancelled jobs whose callbacks have
not run yet. So an owner's queue never holds more than its bound of jobs, live or abandoned,
and an owner already at its bound of jobs waiting is refused another (`Backlogged`): the memory
and the thread time one owner can claim ahead of time are bounded. (A cancelled job used to
stay queued until its turn, and a tenant whose clients connected and left in a loop grew its
queue without bound, every `run` of its scanning it all under the lock.)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class _Job(Generic[T]):
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]
    fn: Callable[..., T]
    args: tuple[Any, ...]

    def run(self) -> None:
        """Run, then settle the future on its loop (unless its caller stopped waiting)."""
        try:
            outcome: tuple[Any, BaseException | None] = (self.fn(*self.args), None)
        except StopIteration as exc:  # a future cannot hold one: its caller would wait forever
            outcome = (None, RuntimeError(f"the job raised StopIteration: {exc!r}"))
        except BaseException as exc:
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            self.loop.call_soon_threadsafe(_settle, self.future, *outcome)


class Backlogged(Exception):
    """The owner already has as many jobs waiting as the pool allows one owner."""


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _live(queue: deque[_Job[Any]]) -> int:
    """Jobs of `queue` whose callers still wait (a cancelled one may not have left yet: its
    done-callback runs in a later turn of its loop)."""
    return sum(not job.future.cancelled() for job in queue)


class FairPool:
    def __init__(self, threads: int, name: str, max_waiting: int | None = None):
        """`threads` threads named `name-<i>`; each owner may have `max_waiting` jobs waiting
        (not yet started) at most, None: no bound."""
        self.max_waiting = max_waiting
        self._ready = threading.Condition()
        self._queues: dict[str, deque[_Job[Any]]] = {}
        self._turns: deque[str] = deque()
        """Owners with jobs waiting, in the order their next jobs run."""
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def run(self, owner: str, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` on one of the threads, in `owner`'s turn; the future is the running
        loop's. Cancelling it before the job starts drops the job. Backlogged when `owner`
        already has `max_waiting` jobs waiting."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the pool is closed")
            queue = self._queues.get(owner)
            if queue is not None and self._full(queue):
                raise Backlogged(f"{self.max_waiting} jobs of this owner are waiting")
            if queue is None:
                queue = self._queues[owner] = deque()
                self._turns.append(owner)
            job = _Job(asyncio.get_running_loop(), future, fn, args)
            queue.append(job)
            self._ready.notify()
        future.add_done_callback(lambda f: self._forget(owner, job) if f.cancelled() else None)
        return future

    def _full(self, queue: deque[_Job[Any]]) -> bool:
        """`queue` holds `max_waiting` jobs whose callers still wait. At the bound, the jobs
        cancelled since (whose done-callbacks have not run yet) leave first, so the queue
        never grows past the bound (a scan of at most `max_waiting` jobs)."""
        bound = self.max_waiting
        if bound is None or len(queue) < bound:
            return False
        live = [job for job in queue if not job.future.cancelled()]
        if len(live) < len(queue):
            queue.clear()
            queue.extend(live)
        return len(queue) >= bound

    def _forget(self, owner: str, job: _Job[Any]) -> None:
        """Drop `job`, whose caller stopped waiting, from its owner's queue (unless it already
        left it: it started, or a `run` at the bound dropped it); an owner left with nothing
        waiting loses its turn."""
        with self._ready:
            queue = self._queues.get(owner)
            if queue is None or job not in queue:
                return
            queue.remove(job)
            if not queue:
                del self._queues[owner]
                self._turns.remove(owner)

    def waiting(self) -> int:
        """Jobs not yet started whose callers still wait."""
        with self._ready:
            return sum(_live(q) for q in self._queues.values())

    def close(self) -> None:
        """Stop the threads once their running jobs end; jobs not started are dropped (their
        callers' futures are cancelled)."""
        with self._ready:
            self._closed = True
            dropped = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._turns.clear()
            self._ready.notify_all()
        for job in dropped:
            with contextlib.suppress(RuntimeError):
                job.loop.call_soon_threadsafe(job.future.cancel)

    def _next(self) -> _Job[Any] | None:
        """The next job to run, in turn; None once the pool is closed."""
        with self._ready:
            while True:
                while not self._turns and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return None
                owner = self._turns.popleft()
                queue = self._queues[owner]
                job = queue.popleft()
                if queue:
                    self._turns.append(owner)  # its next job, after every other owner's
                else:
                    del self._queues[owner]
                if not job.future.cancelled():  # the caller still waits
                    return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            job.run()
