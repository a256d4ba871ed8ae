"""Settlements that could not reach Redis, kept and tried again until Redis answers.

A settlement lost to a brief network failure would leave its request's whole reservation
(`prompt_tokens + max_tokens`) on the budget ledger for the rest of the period, and in the rate
window for a minute; its concurrency slot alone frees itself (with its lease). The SETTLE script
is idempotent (a second run finds nothing left to charge), so a lost settlement is simply tried
again: every waiting one, oldest first, after a backoff doubling from RETRY_FIRST_SECONDS up to
RETRY_MAX_SECONDS for as long as Redis does not answer. Admissions whose reply was lost are
released the same way (settled with 0).

The queue is per process and bounded (LORAMUX_QUOTA_MAX_UNSETTLED): past the bound the oldest
settlement is dropped, and so is one Redis refuses as a command (retrying cannot change that);
each drop is counted (`dropped` in `QuotaService.redis_down`) and logged, as a reservation that
stays charged. `close` tries every waiting settlement once more; those Redis still does not take
are dropped likewise. A gateway that dies loses its queue: what it held stays charged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from redis.exceptions import ResponseError

from loramux.gateway.quotas.admission import Reservation

log = logging.getLogger(__name__)

RETRY_FIRST_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0
DROP_LOG_INTERVAL = 10.0

Settle = Callable[[Reservation, int], Awaitable[None]]
"""One try at a settlement; raises when Redis does not take it."""


class Unsettled:
    """Settlements waiting for Redis, retried by a task of their own (started on the running
    event loop when the first one waits, ended when none is left)."""

    def __init__(self, settle: Settle, bound: int, counts: Counter[str]):
        self._settle = settle
        self.bound = bound
        self._counts = counts
        self._waiting: dict[str, tuple[Reservation, int]] = {}
        self._none_left = asyncio.Event()
        self._none_left.set()
        self._task: asyncio.Task[None] | None = None
        self._drop_logged = -DROP_LOG_INTERVAL

    def __len__(self) -> int:
        """Settlements waiting for Redis."""
        return len(self._waiting)

    def put(self, reservation: Reservation, used_tokens: int) -> None:
        """Keep a settlement Redis did not take, to try again (never raises)."""
        if reservation.member not in self._waiting and len(self._waiting) >= self.bound:
            del self._waiting[next(iter(self._waiting))]
            self._drop(1, f"more than {self.bound} settlements wait for Redis", loud=False)
        self._waiting[reservation.member] = (reservation, used_tokens)
        self._none_left.clear()
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name="quota-unsettled")

    async def settled(self) -> None:
        """Returns once no settlement waits (at once when none does)."""
        await self._none_left.wait()

    async def try_all(self) -> bool:
        """Try every waiting settlement once, oldest first, stopping at the first one Redis does
        not answer; True once none waits."""
        for member, waiting in list(self._waiting.items()):
            try:
                await self._settle(*waiting)
            except ResponseError as exc:  # a refused command: the same again would be refused
                self._drop(1, f"Redis refused the settlement: {exc}", loud=True)
            except Exception:
                return False
            if self._waiting.get(member) is waiting:
                del self._waiting[member]
        if not self._waiting:
            self._none_left.set()
        return not self._waiting

    async def close(self) -> None:
        """Stop retrying in the background and try every waiting settlement once more; drop
        (count and log) what Redis still does not take."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not await self.try_all():
            count = len(self._waiting)
            self._waiting.clear()
            self._none_left.set()
            self._drop(count, "Redis did not answer at shutdown", loud=True)

    async def _run(self) -> None:
        delay = RETRY_FIRST_SECONDS
        while self._waiting:
            await asyncio.sleep(delay)
            settled = await self.try_all()
            delay = RETRY_FIRST_SECONDS if settled else min(2 * delay, RETRY_MAX_SECONDS)

    def _drop(self, count: int, why: str, loud: bool) -> None:
        """Count dropped settlements; log them (at most every DROP_LOG_INTERVAL unless `loud`)."""
        self._counts["dropped"] += count
        now = time.monotonic()
        if loud or now - self._drop_logged >= DROP_LOG_INTERVAL:
            self._drop_logged = now
            log.error(
                "%d quota settlement(s) dropped (%s): their reservations stay charged; "
                "%d dropped since start",
                count,
                why,
                self._counts["dropped"],
            )
