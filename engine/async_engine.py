"""The async facade: submit a request, iterate its deltas; the step loop runs on its own thread.

Only the step thread touches the `LLMEngine`. Other threads talk to it through a command queue
(add, abort) and receive deltas through each request's `asyncio.Queue`, fed with
`call_soon_threadsafe`. A consumer that stops iterating (a client that disconnected) aborts
its request, which frees its KV blocks. A structured request's stream is registered before its
grammar compiles (off the loop): an abort meanwhile is held for it and applied once it is added.

Faults stay with the request they belong to: a request that cannot be added, or that the
engine fails to compute, gets its error on its own stream and the loop goes on. Only what
`LLMEngine.step()` itself raises (its bookkeeping broke, or the device failed) stops the loop:
then every stream gets EngineStoppedError, `running` turns false, and new requests are refused.

The queue (`max_num_seqs + max_waiting` requests) is shared between owners (tenants): when it
is full, a request of an owner with fewer requests queued than another may take the place of
that owner's newest queued request, which is refused instead (engine.queue_share).

A structured output's grammar compiles (up to seconds for a large schema) on threads of its own
(`COMPILE_THREADS`), owners in turn (engine.fair_pool), never on the event loop nor the step
thread; a request whose grammar is already compiled is checked at once, on the event loop, as
an unconstrained one is. So one owner's new schemas delay its own requests and other owners'
new schemas by at most one compile of each owner ahead, never a schema already compiled, nor
adapter registrations (`register_adapter` runs on the loop's default executor, which compiles
used to fill first come, first served: 16 distinct schemas of a second each held another
owner's compiled schema for 11-16 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from loramux.engine.config import EngineConfig
from loramux.engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    RequestFailedError,
)
from loramux.engine.fair_pool import Backlogged, FairPool
from loramux.engine.llm_engine import Checked, LLMEngine
from loramux.engine.lora.stats import AdapterStats
from loramux.engine.outputs import MAX_CACHE_SALT_CHARS, EngineRequest, EngineStats, RequestOutput
from loramux.engine.queue_share import NO_OWNER, displaced, may_displace
from loramux.engine.sequence import FinishReason
from loramux.engine.structured.grammar import NotCompiled

log = logging.getLogger(__name__)

STALL_SECONDS = 600.0
"""One step this long is a hung engine, not a slow one: a step takes milliseconds to seconds,
its first ones on a GPU up to a few minutes while Triton compiles and tunes kernels."""

COMPILE_THREADS = 2
"""Threads compiling structured outputs' grammars (the library releases the interpreter lock
while it compiles)."""


@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    checked: Checked
    displace: bool = False
    """The queue is full: queue it only in place of another owner's queued request."""


@dataclass(frozen=True)
class _Abort:
    request_id: str
    choice: int | None = None


@dataclass(frozen=True)
class _Sweep:
    """Drop retired adapters that no request uses (LLMEngine.sweep_adapters)."""


_SWEEP = _Sweep()


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    owner: str = NO_OWNER
    queued: bool = True
    """No output has reached its consumer yet (counted in `AsyncEngine._queued`)."""
    delivered: bool = False
    """The step thread has handed it an output: it is never displaced after that (a choice
    aborted alone while its request waits has an output, though no sequence ran)."""
    choices: int = 1
    """The request's n."""
    added: bool = False
    """The step thread has taken its `_Add` (set there): aborts reach the engine from then on."""
    held_aborts: set[int | None] = field(default_factory=set)
    """Aborts the step thread took before its `_Add` (the request's grammar was compiling),
    applied once it is added: the whole request (None) or choices below `choices`, so at
    most n + 1 however many aborts came."""

    def hold(self, choice: int | None) -> None:
        if choice is None or 0 <= choice < self.choices:
            self.held_aborts.add(choice)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Sweep | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._queued: Counter[str] = Counter()
        """Streams per owner that have had no output yet (under `_lock`, like `_streams`)."""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._stopping = False
        self._step_since: float | None = None
        """When the step thread began its current step (None between steps)."""
        self._compiles = FairPool(
            COMPILE_THREADS,
            "loramux-grammar",
            engine.config.max_waiting + engine.config.max_num_seqs,
        )
        """Grammar compiles, owners in turn; an owner may have as many waiting as the queue
        holds requests."""

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loramux-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._compiles.close()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def running(self) -> bool:
        """The step thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self._failure is None

    def stalled_for(self) -> float:
        """Seconds the step thread has been in its current step, handing out its outputs
        included; 0 between steps."""
        since = self._step_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def health(self) -> Literal["ok", "stopped", "stalled"]:
        """`stopped` once the step thread ended or failed, `stalled` while one step has run
        longer than STALL_SECONDS (hung); either way it serves nothing. What the engine's
        /health says, and its stats calls refuse (a gateway then counts it down)."""
        if not self.running:
            return "stopped"
        return "stalled" if self.stalled_for() > STALL_SECONDS else "ok"

    @property
    def tokenizer(self) -> object:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def register_adapter(self, folder: Path) -> str:
        """Validate and register a PEFT adapter (off the event loop); returns its digest."""
        return await asyncio.to_thread(self.engine.register_adapter, folder)

    def prefetch_adapter(self, digest: str) -> None:
        """A hint that a request for `digest` follows (see LLMEngine.prefetch_adapter)."""
        self.engine.prefetch_adapter(digest)

    def retire_adapter(self, digest: str) -> bool:
        """Refuse new requests for `digest`; it is unloaded once its in-flight requests end.
        The step thread is woken to drop it at once if none uses it: the drop happens between
        steps, and an idle engine takes none, so it kept the adapter, and its uploaded files (a
        deleted tenant's weights), until another request arrived."""
        retired = self.engine.retire_adapter(digest)
        if retired:
            self._commands.put(_SWEEP)
        return retired

    def adapter_stats(self) -> dict[str, AdapterStats]:
        return self.engine.adapter_stats()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Validate (raising before anything is queued), then yield the request's deltas. A
        request refused for a full queue raises EngineOverloadedError before its first output,
        at once or, when it displaces another owner's queued request, from the step thread; so
        does a queued request displaced by another owner's."""
        self._check_running()
        owner = _owner_of(request)
        checked = self._checked_at_once(request)
        stream = _Stream(
            asyncio.get_running_loop(), asyncio.Queue(), owner, choices=request.params.n
        )
        with self._lock:
            displace = self._register(request.request_id, stream)
        submitted = finished = False
        try:
            if checked is None:
                # Compiling a grammar takes up to seconds (large schemas): not on the event
                # loop, nor on the step thread, which gets the compiled grammar with the
                # request. The stream is registered first: an abort meanwhile is held for it.
                checked = await self._compiled(request, owner)
            self.start()
            self._commands.put(_Add(request, checked, displace))
            submitted = True
            while not finished:
                item = await stream.queue.get()
                if stream.queued:
                    self._unqueue(stream)
                if isinstance(item, BaseException):
                    raise item
                finished = item.is_last  # its last choice ended
                yield item
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            self._unqueue(stream)
            if submitted and not finished:
                self._commands.put(_Abort(request.request_id))

    def _checked_at_once(self, request: EngineRequest) -> Checked | None:
        """The request checked (LLMEngine.checked) when that needs no grammar compile; None
        when it does (`_compiled`)."""
        with contextlib.suppress(NotCompiled):
            return self.engine.checked(request, compile=False)
        return None

    async def _compiled(self, request: EngineRequest, owner: str) -> Checked:
        """The request checked, its grammar compiled on a compile thread in `owner`'s turn.
        EngineOverloadedError when the owner's compiles waiting fill the queue."""
        try:
            job = self._compiles.run(owner, self.engine.checked, request)
        except Backlogged:
            raise EngineOverloadedError(
                "this owner's schemas waiting to compile fill the engine queue; retry later"
            ) from None
        return await job

    def compiles_waiting(self) -> int:
        """Grammar compiles not started yet."""
        return self._compiles.waiting()

    def _register(self, request_id: str, stream: _Stream) -> bool:
        """Take the stream (under `_lock`, which the step loop takes to fail every stream: none
        is left behind); True when the queue is full and it may only displace another owner's
        queued request, EngineOverloadedError when not even that."""
        self._check_running()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        config = self.engine.config
        full = len(self._streams) >= config.max_waiting + config.max_num_seqs
        if full and not may_displace(self._queued, stream.owner):
            raise EngineOverloadedError("the engine queue is full; retry later")
        self._streams[request_id] = stream
        self._queued[stream.owner] += 1
        return full

    def _unqueue(self, stream: _Stream) -> None:
        """`stream` had its first output, or ended: it no longer counts as queued."""
        with self._lock:
            if stream.queued:
                stream.queued = False
                self._queued[stream.owner] -= 1
                if not self._queued[stream.owner]:
                    del self._queued[stream.owner]

    def _check_running(self) -> None:
        if self._failure is not None or self._stopping:
            raise EngineStoppedError("the engine is not running") from self._failure

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """Stop the request (or only its choice `choice`); its stream gets the final output."""
        self._commands.put(_Abort(request_id, choice))

    # -- the step thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_work
                if not self._drain_commands(block):
                    return
                if self.engine.has_work:
                    self._step_since = time.monotonic()
                    self._deliver(self.engine.step())
                    self._step_since = None
        except BaseException as exc:
            log.exception("the engine failed; every request in it fails")
            with self._lock:
                self._failure = exc
                streams = list(self._streams.values())
            for stream in streams:
                stopped = EngineStoppedError(f"the engine failed: {exc!r}")
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, stopped)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. False once shutdown was asked."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Sweep):
                self.engine.sweep_adapters()
            else:
                self._abort(cmd.request_id, cmd.choice)

    def _abort(self, request_id: str, choice: int | None) -> None:
        """Abort in the engine, and deliver the final output; held for a request still on its
        way (its stream registered, its `_Add` not yet taken: `_add` applies it)."""
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None and not stream.added:
            stream.hold(choice)
            return
        final = self.engine.abort(request_id, choice)
        if final is not None:
            self._deliver([final])

    def _add(self, cmd: _Add) -> None:
        """Queue the request in the engine, then apply the aborts held for it; if queueing
        raises, only this request's stream fails."""
        request_id = cmd.request.request_id
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # consumer already gone
        stream.added = True
        if cmd.displace and not self._displace(stream.owner):
            overloaded = EngineOverloadedError("the engine queue is full; retry later")
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, overloaded)
            return
        try:
            self.engine.add_request(cmd.request, checked=cmd.checked)
        except EngineError as exc:
            log.info("request %s refused when queued: %s", request_id, exc)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            return
        except Exception:
            log.exception("request %s could not be queued", request_id)
            failed = RequestFailedError("the engine could not queue this request")
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, failed)
            return
        held = stream.held_aborts
        for choice in [None] if None in held else sorted(c for c in held if c is not None):
            self._abort(request_id, choice)

    def _displace(self, owner: str) -> bool:
        """Refuse the newest queued request of the owner with the most, if `owner` may take its
        place (engine.queue_share): it ends in the engine (its blocks freed, counted as
        aborted) and its stream gets EngineOverloadedError, as at admission. False if none."""
        streams = self._streams
        # Not under `_lock`: the scan reads the whole waiting queue (milliseconds with
        # thousands queued), and the event loop takes the lock for every output it reads. One
        # `dict.get` is atomic; a stream that goes meanwhile is skipped, or found gone below.

        def owner_of(request_id: str) -> str | None:
            stream = streams.get(request_id)
            return None if stream is None or stream.delivered else stream.owner

        victim = displaced(self.engine.scheduler.waiting, owner_of, owner)
        stream = None if victim is None else streams.get(victim)
        if victim is None or stream is None:
            return False
        log.info("request %s refused: its owner holds the most of the full queue", victim)
        self.engine.abort(victim)
        overloaded = EngineOverloadedError("the engine queue is full; retry later")
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, overloaded)
        return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its stream; a failed request's last one is raised there. A step's
        outputs cross to each event loop in one call (one wake-up of the loop, not one per
        request), so its consumers all run in the same turn of the loop."""
        with self._lock:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, _Item]]] = {}
        for stream, out in targets:
            if stream is None:
                continue
            stream.delivered = True
            item: _Item = out
            if out.finish_reason is FinishReason.ERROR:
                item = out.error_type(out.error or "the engine could not finish this request")
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


_Item = RequestOutput | BaseException


def _owner_of(request: EngineRequest) -> str:
    """The request's owner, checked: a string of at most MAX_CACHE_SALT_CHARS characters."""
    owner = request.owner
    if owner is None:
        return NO_OWNER
    if not isinstance(owner, str) or len(owner) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"owner must be a string of at most {MAX_CACHE_SALT_CHARS} characters"
        )
    return owner


def _put_all(items: list[tuple[_Stream, _Item]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
