"""One engine request, run in a task of its own so that its end is always seen and billed.

The HTTP response only reads what the task produced. Whatever the client does (reads to the end,
disconnects mid-stream, leaves before a non-streamed answer is ready), the task reads the
engine's stream to its end and then calls `on_end` exactly once: the service meters, caches and
settles the reservation there, by the tokens the engine generated.

The engine streams token ids, each output tagged with its choice (`RequestOutput.index`, 0..n-1
for a request with n choices); the text is made here (one IncrementalDetokenizer per choice), and
so are stop strings matched. When a stop string matches in a choice, its text ends before it and
the choice finishes with `stop`, and the engine is asked to abort that choice's sequence (the
request's other choices go on; once every choice has ended, the request). The tokens the engine
generates for it until the abort lands (a step or two) are dropped: nobody receives them and
nobody is billed for them (a choice counts its tokens up to the one that completed the stop
string). A client that cannot stop one choice (Ray) runs it until the request ends.

A client that leaves calls `abort`: the engine stops the sequence and ends the stream with a
final output whose usage counts every token it generated, delivered or not. A request that
fails after generation started counts the token ids of the deltas it received.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from loramux.engine.detokenizer import IncrementalDetokenizer
from loramux.engine.outputs import EngineRequest, RequestOutput, RequestTimings, TokenLogprob, Usage
from loramux.engine.sequence import FinishReason
from loramux.engine.structured import StructuredOutputError
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.errors import BadRequest, GatewayError, as_gateway_error

log = logging.getLogger(__name__)

_IN_FLIGHT: set[asyncio.Task[Any]] = set()
"""Tasks of generations and aborts under way: the event loop keeps only weak references."""


@dataclass(frozen=True)
class ChoiceDelta:
    """What a run adds to one choice: text made from the engine's token ids, the tokens it was
    made from (with their logprobs when asked for, and where each token's text starts in the
    choice's text), and the choice's finish reason on its last delta."""

    index: int
    text: str
    finish_reason: str | None
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    offsets: list[int]


@dataclass
class ChoiceRun:
    """One choice of a run: its detokenizer (which matches the stop strings) and what it
    produced so far. `received` counts every token id the engine sent for it, those after a
    stop string matched included; `stopped_at` is how many had been received when one did."""

    index: int
    detokenizer: IncrementalDetokenizer
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    received: int = 0
    stopped_at: int | None = None
    finish: str | None = None
    engine_done: bool = False
    """The engine ended this choice (it goes on after a stop string matched here)."""

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def take(self, out: RequestOutput) -> ChoiceDelta | None:
        """The delta `out` makes; None once the choice ended (the tokens after a stop string,
        which nobody receives)."""
        self.engine_done = self.engine_done or out.finish_reason is not None
        if self.finish is not None:
            self.received += len(out.token_ids)
            return None
        detok = self.detokenizer
        text, ids, offsets = "", [], []
        for token in out.token_ids:
            self.received += 1
            ids.append(token)
            # where the token's text starts: after all the text decoded so far, released or held
            # back (a tail that could begin a stop string is released later, or never)
            offsets.append(len(detok.text))
            text += detok.add(token)
            if detok.stopped:
                self.stopped_at = self.received
                break
        finish = FinishReason.STOP if detok.stopped else out.finish_reason
        if finish is not None:
            stopped = detok.stopped
            text += detok.flush()
            if detok.stopped and not stopped:  # the held bytes' U+FFFD completed a stop string
                finish, self.stopped_at = FinishReason.STOP, self.received
            self.finish = finish
        logprobs = out.logprobs[: len(ids)] if out.logprobs is not None else None
        self._keep(text, ids, logprobs, offsets)
        return ChoiceDelta(self.index, text, finish, ids, logprobs, offsets)

    def _keep(
        self, text: str, ids: list[int], logprobs: list[TokenLogprob] | None, offsets: list[int]
    ) -> None:
        self.texts.append(text)
        self.token_ids += ids
        self.offsets += offsets
        if logprobs is not None:
            self.logprobs += logprobs


def _spawn(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    task = asyncio.get_running_loop().create_task(work)
    _IN_FLIGHT.add(task)
    task.add_done_callback(_IN_FLIGHT.discard)
    return task


class Generation:
    """A running engine request and what it produced so far, choice by choice.

    `left` is set when the client went away before the end (`abort`); `error` is the error that
    ended the stream, if any. Read the deltas with `deltas()` (one reader); they end once the
    run has ended and been billed.
    """

    def __init__(
        self,
        engine: EngineClient,
        request: EngineRequest,
        detokenizer: Callable[[], IncrementalDetokenizer],
        started: float,
        on_end: Callable[[Generation], Awaitable[None]],
        schema_param: str = "response_format",
    ):
        self.engine = engine
        self.schema_param = schema_param
        """The request field whose schema the engine refuses, if it does: `response_format`,
        or `tools` for a forced call's."""
        self.request = request
        self.started = started
        """When the request arrived (time.perf_counter): the time to first token counts from it."""
        self.choices = [ChoiceRun(i, detokenizer()) for i in range(request.params.n)]
        self.usage: Usage | None = None
        self.error: GatewayError | None = None
        self.ttft: float | None = None
        self.timings: RequestTimings | None = None
        """The engine's timestamps of the request, from its final output."""
        self.left = False
        self.ended = False
        self._on_end = on_end
        self._submitted = False
        self._aborted = False
        self._deltas: asyncio.Queue[ChoiceDelta | None] = asyncio.Queue()
        self._opened = asyncio.Event()
        """Set at the run's first output, or at its end if it had none."""
        self.task = _spawn(self._run())

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason."""
        return all(c.finish is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        """Tokens billed: each choice's up to its stop string when one matched, else those
        received; plus, when the engine reported its count (a finished or aborted request),
        what it generated beyond what was received, unless every choice ended at a stop string
        (the engine's abort then only cut the tokens nobody receives)."""
        billed = sum(c.received if c.stopped_at is None else c.stopped_at for c in self.choices)
        if self.usage is None or all(c.stopped_at is not None for c in self.choices):
            return billed
        return billed + max(0, self.usage.completion_tokens - sum(c.received for c in self.choices))

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens if self.usage is not None else 0

    @property
    def refused(self) -> GatewayError | None:
        """The error that ended the run before its first output (the engine down, overloaded
        or late; a request it refused), if one did: nothing of an answer was made."""
        return self.error if self.ttft is None else None

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
        self._abort_engine()

    async def opened(self) -> None:
        """Returns once the run has had its first output, or has ended (and been billed)
        without one."""
        await self._opened.wait()

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choices' deltas as they arrive, ending once the run has ended and been billed."""
        while (out := await self._deltas.get()) is not None:
            yield out

    async def _run(self) -> None:
        try:
            if not self.left:  # a client that left before the run started costs nothing
                # Asking for the first output hands the request to the engine before this task
                # first waits, so an `abort` from now on reaches a request the engine has.
                self._submitted = True
                await self.engine.stream(self.request, self._take)
        except StructuredOutputError as exc:  # the engine's compile refused the schema
            self.error = BadRequest(str(exc), param=self.schema_param, code="invalid_request")
        except Exception as exc:
            self.error = as_gateway_error(exc)
        finally:
            try:
                await self._on_end(self)
            except Exception:
                log.exception("finishing request %s failed", self.request.request_id)
            finally:
                self.ended = True
                self._opened.set()
                self._deltas.put_nowait(None)

    def _take(self, out: RequestOutput) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.started
            self._opened.set()
        self.usage = out.usage or self.usage
        self.timings = out.timings or self.timings
        choice = self.choices[out.index]
        delta = choice.take(out)
        if delta is not None:
            self._deltas.put_nowait(delta)
            if choice.stopped_at is not None and not choice.engine_done and not self.finished:
                self._abort_engine(choice.index)  # the others go on
        if self.finished and not all(c.engine_done for c in self.choices):
            # Every choice has ended here, some at a stop string, which the engine does not
            # match: its sequences for those go on until aborted.
            self._abort_engine()

    def _abort_engine(self, choice: int | None = None) -> None:
        """Stop the engine's request, or only its choice `choice`."""
        if self._submitted and not self._aborted:
            self._aborted = choice is None
            _spawn(self.engine.abort(self.request.request_id, choice))
