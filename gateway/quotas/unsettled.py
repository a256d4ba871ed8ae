"""Settlements that could not reach Redis, kept and tried again until Redis answers.

A settlement lost to a brief network failure would leave its request's whole reservation
(`prompt_tokens + max_tokens`) on the budget ledger for the rest of the period, and in the rate
window for a minute; its concurrency slot alone frees itself (with its lease). The SETTLE script
is idempotent (a second run finds nothing left to charge), so a lost settlement is simply tried
again: every waiting one, oldest first, after a backoff doubling from RETRY_FIRST_SECONDS up to
RETRY_MAX_SECONDS for as long as Redis does not answer. Admissions whose reply was lost are
released the same way (settled with 0).

Redis refusing a settlement is mostly passing too: READONLY while a replica is promoted in a
failover, OOM, MISCONF, BUSY, LOADING, NOSCRIPT, TRYAGAIN, and any refusal not known here; such
a settlement waits like one Redis did not answer. Only a refusal that no retry can change (a bug
in the script or its arguments: ERR, WRONGTYPE, CROSSSLOT; `refused_for_good`) drops it.

The queue is per process and bounded (LORAMUX_QUOTA_MAX_UNSETTLED): past the bound the oldest
settlement is dropped. Each drop is counted (`dropped` in `QuotaService.redis_down`) and logged,
as a reservation that stays charged: at most every DROP_LOG_INTERVAL, each line with the drops
since the last, so a burst of them is one line. `close` tries every waiting settlement once
more; those Redis still does not take are dropped likewise (logged at once). A gateway that dies
loses its queue: what it held stays charged.
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

PERMANENT_CODES = frozenset({"ERR", "WRONGTYPE", "CROSSSLOT"})
"""Error codes of a refusal caused by the command itself: the script failed, or its keys or
arguments are wrong. The same command would be refused again."""

PASSING_CODES = ("READONLY", "OOM", "MISCONF", "BUSY", "LOADING", "NOSCRIPT", "TRYAGAIN")
"""Codes of refusals Redis stops making on its own, looked for inside an ERR too: Redis 6
reports the error of a command a script called as `ERR Error running script … -OOM …`."""

RETRY_FIRST_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0
DROP_LOG_INTERVAL = 10.0

Settle = Callable[[Reservation, int], Awaitable[None]]
"""One try at a settlement; raises when Redis does not take it."""


def refused_for_good(exc: BaseException) -> bool:
    """Whether Redis refused a settlement for what it is (PERMANENT_CODES), so that trying it
    again cannot succeed. Anything else (no answer, or a refusal of a state that passes or of a
    code not known here) is worth trying again: a settlement is dropped only on certainty."""
    if not isinstance(exc, ResponseError):
        return False
    text = str(exc)
    code = getattr(exc, "status_code", None) or text.split(" ", 1)[0]
    return code in PERMANENT_CODES and not any(f"-{c} " in text for c in PASSING_CODES)


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
        self._unlogged = 0

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
        not take (unless `refused_for_good`: that one is dropped); True once none waits."""
        refused: list[BaseException] = []
        try:
            for member, waiting in list(self._waiting.items()):
                try:
                    await self._settle(*waiting)
                except Exception as exc:
                    if not refused_for_good(exc):
                        return False
                    refused.append(exc)
                if self._waiting.get(member) is waiting:
                    del self._waiting[member]
        finally:
            if refused:
                why = f"Redis refused them as commands, the last: {refused[-1]}"
                self._drop(len(refused), why, loud=False)
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
        """Count dropped settlements; log them, with the drops not logged yet (at most every
        DROP_LOG_INTERVAL unless `loud`), so a burst of drops is one line."""
        self._counts["dropped"] += count
        self._unlogged += count
        now = time.monotonic()
        if loud or now - self._drop_logged >= DROP_LOG_INTERVAL:
            self._drop_logged = now
            log.error(
                "%d quota settlement(s) dropped (%s): their reservations stay charged; "
                "%d dropped since start",
                self._unlogged,
                why,
                self._counts["dropped"],
            )
            self._unlogged = 0
