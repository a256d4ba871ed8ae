"""One engine request, run in a task of its own so that its end is always seen and billed.

The HTTP response only reads what the task produced. Whatever the client does (reads to the end,
disconnects mid-stream, leaves before a non-streamed answer is ready), the task reads the
engine's stream to its end and then calls `on_end` exactly once: the service meters, caches and
settles the reservation there, by the tokens the engine generated.

The engine streams token ids; the text is made here (one IncrementalDetokenizer per run), and
so are stop strings matched. When a stop string matches, the text ends before it, the run
finishes with `stop`, and the engine's sequence is aborted: it may have generated a token or
two more by then, which nobody receives and nobody is billed for (the run counts the tokens up
to the one that completed the stop string).

A client that leaves calls `abort`: the engine stops the sequence and ends the stream with a
final output whose usage counts every token it generated, delivered or not. A request that
fails after generation started counts the token ids of the deltas it received.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import EngineRequest, RequestOutput, RequestTimings, Usage
from engine.sequence import FinishReason
from gateway.engine_client.base import EngineClient
from gateway.errors import GatewayError, as_gateway_error

log = logging.getLogger(__name__)

_IN_FLIGHT: set[asyncio.Task[Any]] = set()
"""Tasks of generations and aborts under way: the event loop keeps only weak references."""


@dataclass(frozen=True)
class TextDelta:
    """What a run adds to the response: text made from the engine's token ids."""

    text: str
    finish_reason: str | None


def _spawn(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    task = asyncio.get_running_loop().create_task(work)
    _IN_FLIGHT.add(task)
    task.add_done_callback(_IN_FLIGHT.discard)
    return task


class Generation:
    """A running engine request and what it produced so far.

    `left` is set when the client went away before the end (`abort`); `error` is the error that
    ended the stream, if any. Read the deltas with `deltas()` (one reader) or wait for the end
    with `wait()`.
    """

    def __init__(
        self,
        engine: EngineClient,
        request: EngineRequest,
        detokenizer: IncrementalDetokenizer,
        started: float,
        on_end: Callable[[Generation], Awaitable[None]],
    ):
        self.engine = engine
        self.request = request
        self.detokenizer = detokenizer
        self.started = started
        self.texts: list[str] = []
        self.received_tokens = 0
        """Token ids of the deltas received."""
        self.usage: Usage | None = None
        self.stopped_at: int | None = None
        """Tokens received when a stop string matched; None while none has."""
        self.finish: str | None = None
        self.error: GatewayError | None = None
        self.ttft: float | None = None
        self.timings: RequestTimings | None = None
        """The engine's timestamps of the request, from its final output."""
        self.left = False
        self.ended = False
        self._on_end = on_end
        self._submitted = False
        self._deltas: asyncio.Queue[TextDelta | None] = asyncio.Queue()
        self.task = _spawn(self._run())

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def completion_tokens(self) -> int:
        """Tokens the engine generated: up to the stop string's when one matched, else its own
        count when it reported one (a finished or aborted request), else the token ids
        received (a stream that broke)."""
        if self.stopped_at is not None:
            return self.stopped_at
        return self.usage.completion_tokens if self.usage is not None else self.received_tokens

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens if self.usage is not None else 0

    @property
    def status(self) -> int:
        """200, 499 when the client left before the end, or the error's status."""
        if self.left:
            return 499
        return self.error.status if self.error is not None else 200

    def abort(self) -> None:
        """The client left: stop the engine's sequence. The run still ends, and is billed, by
        itself. Does nothing once the run ended; never blocks (callable while cancelled)."""
        if self.ended or self.left:
            return
        self.left = True
        if self._submitted:
            _spawn(self.engine.abort(self.request.request_id))

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """The engine's outputs as they arrive, ending once the run has ended and been billed."""
        while (out := await self._deltas.get()) is not None:
            yield out

    async def wait(self, client_gone: Awaitable[None]) -> None:
        """Until the run has ended and been billed, or the client is gone (then abort)."""
        watcher = asyncio.ensure_future(client_gone)
        try:
            await asyncio.wait({self.task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            self.abort()

    async def _run(self) -> None:
        try:
            if not self.left:  # a client that left before the run started costs nothing
                # Asking for the first output hands the request to the engine before this task
                # first waits, so an `abort` from now on reaches a request the engine has.
                self._submitted = True
                async for out in self.engine.generate(self.request):
                    self._take(out)
        except Exception as exc:
            self.error = as_gateway_error(exc)
        finally:
            try:
                await self._on_end(self)
            except Exception:
                log.exception("finishing request %s failed", self.request.request_id)
            finally:
                self.ended = True
                self._deltas.put_nowait(None)

    def _take(self, out: RequestOutput) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.started
        self.usage = out.usage or self.usage
        self.timings = out.timings or self.timings
        if self.stopped_at is not None:
            return  # the rest of a stream whose stop string matched: the engine's abort
        detok = self.detokenizer
        text = ""
        for token in out.token_ids:
            self.received_tokens += 1
            text += detok.add(token)
            if detok.stopped:
                self._stop()
                break
        finish = FinishReason.STOP if detok.stopped else out.finish_reason
        if finish is not None:
            text += detok.flush()
            self.finish = finish
        self.texts.append(text)
        self._deltas.put_nowait(TextDelta(text, finish))

    def _stop(self) -> None:
        """A stop string matched: end the text here and stop the engine's sequence."""
        self.stopped_at = self.received_tokens
        if not self.left:
            _spawn(self.engine.abort(self.request.request_id))
