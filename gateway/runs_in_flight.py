"""The engine runs of one gateway that have not ended yet (gateway.openai.generation).

A run outlives its response when the response is cut: a client that left, or the end of the
grace period at shutdown. Each run meters itself as it ends; at shutdown, `end` sees every run
still going ended before the usage recorder closes: a run that ended after it was billed to
nobody.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)


class Run(Protocol):
    """A run of the engine: `task` ends once it has ended and been metered."""

    @property
    def task(self) -> asyncio.Task[Any]: ...

    def abort(self) -> None:
        """Stop the engine's sequence; the run still ends, and is metered, by itself."""


R = TypeVar("R", bound=Run)


class RunsInFlight:
    """Runs held from their start until they have ended."""

    def __init__(self) -> None:
        self._runs: set[Run] = set()

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, run: R) -> R:
        """Hold `run` until it has ended; returns it."""
        self._runs.add(run)
        run.task.add_done_callback(lambda _: self._runs.discard(run))
        return run

    async def end(self, seconds: float) -> None:
        """Abort every run still going and wait up to `seconds` for them to end (each is
        metered and settled as it ends); one that has not by then is logged, not waited for."""
        runs = list(self._runs)
        if not runs:
            return
        for run in runs:
            run.abort()
        _, pending = await asyncio.wait([run.task for run in runs], timeout=seconds)
        if pending:
            log.error(
                "%d engine runs did not end within %.0f s of their abort", len(pending), seconds
            )
