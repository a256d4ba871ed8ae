"""Concurrency slots are leases: a slot holds its place only until its expiry, and this process
renews the slots of its running requests every third of a lease. A gateway that dies stops
renewing, so its slots expire within one lease (LORAMUX_QUOTA_SLOT_LEASE_SECONDS) and are
dropped by the next admission's script; they never leak. A request outliving its lease keeps
its slot as long as its gateway lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from loramux.gateway.quotas.scripts import RENEW

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews the slots of this process's running requests. The renewal task starts with the
    first slot held, on the running event loop; `close` stops it."""

    def __init__(
        self, redis: Redis, lease_ms: int, now_ms: Callable[[], int], timeout: float
    ) -> None:
        self.redis = redis
        self.lease_ms = lease_ms
        self.timeout = timeout
        """Seconds a renewal waits on Redis: a connection to a Redis gone silent (a host that
        drops packets answers no RST) would otherwise hold every later renewal."""
        self.now_ms = now_ms
        self._renew = redis.register_script(RENEW)
        self._held: dict[str, tuple[str, ...]] = {}
        self._task: asyncio.Task[None] | None = None

    def hold(self, member: str, slot_keys: tuple[str, ...]) -> None:
        self._held[member] = slot_keys
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="quota-slot-leases"
            )

    def release(self, member: str) -> None:
        self._held.pop(member, None)

    async def renew_all(self) -> None:
        """Push every held slot's expiry one lease ahead (one pipelined round trip); TimeoutError
        past `timeout`."""
        held = list(self._held.items())
        if not held:
            return
        async with asyncio.timeout(self.timeout), self.redis.pipeline(transaction=False) as pipe:
            for member, keys in held:
                await self._renew(
                    keys=keys, args=[self.now_ms(), self.lease_ms, member], client=pipe
                )
            await pipe.execute()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                await self.renew_all()
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("could not renew %d concurrency slots: %s", len(self._held), exc)
