"""Usage metering: append-only events, written to SQL in batches off the request path.

`record` only appends to an in-memory buffer; a background task inserts the buffer every
`interval` seconds (or sooner when it fills) in one transaction. `close` drains everything, so a
clean shutdown loses nothing. A failed insert keeps the batch for the next try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import UsageEvent
from gateway.db.base import utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    adapter_digest: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache: str
    status: int
    latency_ms: float
    ttft_ms: float | None
    created_at: datetime = field(default_factory=utcnow)


class UsageRecorder:
    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], interval: float = 0.5, batch: int = 2000
    ):
        self.sessions = sessions
        self.interval = interval
        self.batch = batch
        self._buffer: list[UsageRecord] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-recorder")

    def record(self, event: UsageRecord) -> None:
        self._buffer.append(event)
        if len(self._buffer) >= self.batch:
            self._wake.set()

    async def flush(self) -> int:
        """Insert everything buffered now; returns how many events were written."""
        written = 0
        while self._buffer:
            chunk, self._buffer = self._buffer[: self.batch], self._buffer[self.batch :]
            try:
                async with self.sessions() as session, session.begin():
                    await session.execute(insert(UsageEvent), [asdict(e) for e in chunk])
            except Exception:
                self._buffer[:0] = chunk
                raise
            written += len(chunk)
        return written

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception(
                    "usage events could not be written; %d kept for retry", len(self._buffer)
                )
