"""Concurrent loads of one thing share a single run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """`run(key, load)` starts `load()` unless a run for `key` is under way, and every caller
    gets that run's result or exception. A cancelled caller does not cancel the run the others
    wait on. Belongs to one event loop."""

    def __init__(self) -> None:
        self._pending: dict[K, asyncio.Future[V]] = {}

    async def run(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        future = self._pending.get(key)
        if future is None:
            future = asyncio.ensure_future(load())
            self._pending[key] = future
            future.add_done_callback(lambda done: self._done(key, done))
        return await asyncio.shield(future)

    def _done(self, key: K, future: asyncio.Future[V]) -> None:
        self._pending.pop(key, None)
        if not future.cancelled():
            future.exception()  # retrieved: the callers that are still waiting re-raise it
