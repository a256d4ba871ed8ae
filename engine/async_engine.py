"""The async facade: submit a request, iterate its deltas; the step loop runs on its own thread.

Only the step thread touches the `LLMEngine`. Other threads talk to it through a command queue
(add, abort) and receive deltas through each request's `asyncio.Queue`, fed with
`call_soon_threadsafe`. A consumer that stops iterating (a client that disconnected) aborts
its request, which frees its KV blocks.

Faults stay with the request they belong to: a request that cannot be added, or that the
engine fails to compute, gets its error on its own stream and the loop goes on. Only what
`LLMEngine.step()` itself raises (its bookkeeping broke, or the device failed) stops the loop:
then every stream gets EngineStoppedError, `running` turns false, and new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from loramux.engine.config import EngineConfig
from loramux.engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    RequestFailedError,
)
from loramux.engine.llm_engine import Checked, LLMEngine
from loramux.engine.lora.stats import AdapterStats
from loramux.engine.outputs import EngineRequest, EngineStats, RequestOutput
from loramux.engine.sequence import FinishReason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    checked: Checked


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


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Sweep | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._stopping = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loramux-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def running(self) -> bool:
        """The step thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self._failure is None

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
        """Validate (raising before anything is queued), then yield the request's deltas."""
        self._check_running()
        if request.params.structured is None:
            checked = self.engine.checked(request)
        else:
            # Compiling a grammar takes up to seconds (large schemas): not on the event loop,
            # nor on the step thread, which gets the compiled grammar with the request.
            checked = await asyncio.to_thread(self.engine.checked, request)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            # Under the lock the step loop takes to fail every stream: none is left behind.
            self._check_running()
            if request.request_id in self._streams:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
            if (
                len(self._streams)
                >= self.engine.config.max_waiting + self.engine.config.max_num_seqs
            ):
                raise EngineOverloadedError("the engine queue is full; retry later")
            self._streams[request.request_id] = stream
        self.start()
        self._commands.put(_Add(request, checked))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.is_last  # its last choice ended
                yield item
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:
                self._commands.put(_Abort(request.request_id))

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
                    self._deliver(self.engine.step())
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
                final = self.engine.abort(cmd.request_id, cmd.choice)
                if final is not None:
                    self._deliver([final])

    def _add(self, cmd: _Add) -> None:
        """Queue the request in the engine; if that raises, only this request's stream fails."""
        with self._lock:
            stream = self._streams.get(cmd.request.request_id)
        if stream is None:
            return  # consumer already gone
        try:
            self.engine.add_request(cmd.request, checked=cmd.checked)
        except EngineError as exc:
            log.info("request %s refused when queued: %s", cmd.request.request_id, exc)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
        except Exception:
            log.exception("request %s could not be queued", cmd.request.request_id)
            failed = RequestFailedError("the engine could not queue this request")
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, failed)

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
            item: _Item = out
            if out.finish_reason is FinishReason.ERROR:
                item = out.error_type(out.error or "the engine could not finish this request")
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


_Item = RequestOutput | BaseException


def _put_all(items: list[tuple[_Stream, _Item]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
