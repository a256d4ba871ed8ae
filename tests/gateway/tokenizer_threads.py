"""The gateway's tokenizer threads held busy, so a test can act while a prompt waits for one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from loramux.gateway.prompt_tokens import TOKENIZER_THREADS
from loramux.gateway.server import RunningServer


@contextlib.contextmanager
def tokenizer_threads_held(gateway: RunningServer) -> Iterator[None]:
    """Every tokenizer thread of the gateway busy (real jobs on its own pool) until exit."""
    release, started = threading.Event(), threading.Semaphore(0)

    def busy() -> None:
        started.release()
        release.wait(60)

    async def hold() -> None:
        await gateway.state.prompts._pool.run("holder", busy)

    holders = [
        asyncio.run_coroutine_threadsafe(hold(), gateway.loop) for _ in range(TOKENIZER_THREADS)
    ]
    try:
        for _ in range(TOKENIZER_THREADS):
            assert started.acquire(timeout=30)
        yield
    finally:
        release.set()
        for holder in holders:
            holder.result(timeout=30)
