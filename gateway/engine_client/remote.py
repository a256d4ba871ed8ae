"""The remote engine client: one or more engines over the ZeroMQ channel (engine.service.wire),
`ipc://` for serve's own engine and `tcp://` for engines named by LORAMUX_ENGINE_URLS.

Each call is routed (gateway.engine_client.routing) and fails over to the next engine while the
chosen one is unreachable, stopped or overloaded; an engine that fails is passed over for a short
while. An engine is used only once admitted on its current connection
(gateway.engine_client.admission): one that serves another model than the others is refused.
Typed engine errors come back as the same classes the engine raised. Adapters travel on
demand: `ensure_adapter` remembers the adapter's folder, and an engine that is about to serve a
digest it is not known to hold gets the files first; an engine that answers "unknown adapter"
(it restarted) gets them again, once, and the call is retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import zmq.asyncio

from loramux.engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    UnknownAdapterError,
)
from loramux.engine.outputs import EngineRequest, EngineStats, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.engine.service.wire import UPLOAD_PART_BYTES, Delta, Generate
from loramux.gateway.engine_client.admission import Admission
from loramux.gateway.engine_client.base import (
    EngineInfo,
    EngineTimeoutError,
    EngineVersionError,
)
from loramux.gateway.engine_client.channel import Channel
from loramux.gateway.engine_client.deltas import PushSink, next_delta, output_of
from loramux.gateway.engine_client.routing import Endpoint, adapter_key, affinity_key, route
from loramux.gateway.engine_client.uploads import send_adapter
from loramux.gateway.settings import ENGINE_FIRST_OUTPUT_SECONDS

log = logging.getLogger(__name__)

T = TypeVar("T")

LOAD_REFRESH_SECONDS = 0.5
"""Engine loads (for routing) are refreshed from stats at most this often."""
CALL_SECONDS, PROBE_SECONDS = 30.0, 5.0
MAX_WIRE_INT = 2**63 - 1
"""msgpack carries 64-bit integers; a larger top_k keeps every token all the same."""


class RemoteEngineClient:
    def __init__(
        self,
        urls: list[str],
        token: str | None = None,
        first_output_seconds: float = ENGINE_FIRST_OUTPUT_SECONDS,
        upload_part_bytes: int = UPLOAD_PART_BYTES,
    ):
        if not urls:
            raise ValueError("a remote engine client needs at least one engine URL")
        self._endpoints = [Endpoint(url) for url in urls]
        self._token = token
        self._first_output_seconds = first_output_seconds
        self._part_bytes = upload_part_bytes
        """The weights each part of an adapter upload carries (engine.service.wire)."""
        self._context: zmq.asyncio.Context | None = None
        self._channels: dict[str, Channel] = {}
        self._admission = Admission(self._channel)
        self._folders: dict[str, Path] = {}
        """Adapter folders given to `ensure_adapter`, by digest: what can be uploaded."""
        self._upload_locks: dict[str, asyncio.Lock] = {}
        self._serving: dict[str, _Serving] = {}
        """Requests whose `generate` stream is open or opening, by request id."""
        self._loads_at = 0.0
        self._refresh: asyncio.Task[list[EngineStats | None]] | None = None

    async def start(self) -> None:
        """Connect, and admit each engine that answers (the first in LORAMUX_ENGINE_URLS order
        sets the model all must serve); the others are admitted once they answer."""
        await self._admission.start(self._endpoints)

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        if self._context is not None:
            self._context.term()

    def _channel(self, endpoint: Endpoint) -> Channel:
        """The endpoint's channel, opened on first use (on the running event loop)."""
        channel = self._channels.get(endpoint.url)
        if channel is None:
            self._context = self._context or zmq.asyncio.Context()
            channel = self._channels[endpoint.url] = Channel(self._context, endpoint, self._token)
        return channel

    async def info(self) -> EngineInfo:
        """The model every engine serves: that of the first engine admitted (an engine serving
        another is refused). EngineStoppedError while none answers."""
        return await self._admission.served_model(self._endpoints)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Typed errors are raised before the first delta; closing early aborts the engine's
        sequence. The request must carry token ids; outputs carry token ids."""
        channel, delta = await self._open(request)
        finished = False
        try:
            while True:
                finished = delta.usage is not None  # the request's last choice ended
                yield output_of(delta)
                if finished:
                    return
                delta = await next_delta(channel.streams[request.request_id])
        finally:
            self._close(channel, request.request_id, finished)

    async def stream(self, request: EngineRequest, sink: Callable[[RequestOutput], None]) -> None:
        """`generate`, pushed: the channel's reader hands each output to `sink` as it reads it,
        waking no task per token. Raises what `generate` does, and what `sink` raised (the
        engine's sequence then aborted)."""
        channel, delta = await self._open(request)
        request_id = request.request_id
        finished = False
        try:
            push = PushSink(sink, asyncio.get_running_loop().create_future())
            push.put_nowait(delta)
            queue = channel.streams[request_id]
            while isinstance(queue, asyncio.Queue) and not queue.empty():  # arrived meanwhile
                push.put_nowait(queue.get_nowait())
            channel.streams[request_id] = push
            await push.done
            finished = True
        finally:
            self._close(channel, request_id, finished)

    async def _open(self, request: EngineRequest) -> tuple[Channel, Delta]:
        """The request on an engine's channel and its first delta; its stream is registered
        (`_close` ends it). Typed errors, and nothing registered, when it cannot open."""
        if request.prompt_token_ids is None:
            raise InvalidRequestError("the engine takes prompts as token ids")
        message = Generate(
            self._token or "",
            request.request_id,
            request.prompt_token_ids,
            _wire_params(request.params),
            request.adapter,
            request.cache_salt,
            request.owner,
        )
        serving = self._serving[request.request_id] = _Serving()

        async def open_stream(endpoint: Endpoint) -> Delta:
            channel = self._channel(endpoint)
            channel.streams[request.request_id] = asyncio.Queue()
            try:
                await channel.send(message)
                # The engine has the request from here on: an abort goes to it at once (one
                # that came while it was sent goes now), and the first delta is its end.
                serving.channel = channel
                if serving.aborted:
                    channel.abort(request.request_id)
                return await self._first_delta(channel, request.request_id)
            except BaseException:
                serving.channel = None
                del channel.streams[request.request_id]
                raise

        def abandoned() -> bool:
            return serving.aborted

        key = affinity_key(request)
        try:
            delta = await self._on_engine(key, request.adapter, open_stream, abandoned)
        except BaseException:
            del self._serving[request.request_id]
            raise
        assert serving.channel is not None
        return serving.channel, delta

    def _close(self, channel: Channel, request_id: str, finished: bool) -> None:
        """The request's stream ends here; the engine's sequence is aborted unless it finished."""
        del self._serving[request_id]
        del channel.streams[request_id]
        if not finished:
            channel.abort(request_id)

    async def _first_delta(self, channel: Channel, request_id: str) -> Delta:
        """The first delta of `request_id` on `channel`; EngineTimeoutError, with the request
        aborted on the engine, when none comes within the first-output deadline. Later deltas
        have no deadline: a stream that started is as long as the client wants it."""
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for wraps the wait in a task
            # of its own, one more task and loop turn on every request's way to its first token
            async with asyncio.timeout(self._first_output_seconds):
                return await next_delta(channel.streams[request_id])
        except TimeoutError:
            channel.abort(request_id)
            raise EngineTimeoutError(
                f"engine {channel.endpoint.url} gave no first output within "
                f"{self._first_output_seconds:g} s"
            ) from None

    async def abort(self, request_id: str, choice: int | None = None) -> None:
        """Ask the engine serving `request_id` to abort it (or, once sent, its choice `choice`);
        the stream ends with the engine's final output. One not yet sent to an engine is
        aborted once sent, and tried on no other engine when its engine fails."""
        serving = self._serving.get(request_id)
        if serving is None or serving.aborted or (choice is not None and serving.channel is None):
            return
        serving.aborted = choice is None
        if serving.channel is not None:
            serving.channel.abort(request_id, choice)

    async def ensure_adapter(self, digest: str, folder: Path) -> None:
        """Remember the adapter's files and upload them to its preferred engine if it lacks them."""
        self._folders[digest] = folder
        self._admission.forgive_retire(digest)

        async def nothing(endpoint: Endpoint) -> None:
            return None

        await self._on_engine(adapter_key(digest), digest, nothing)

    def prefetch_adapter(self, digest: str) -> None:
        """Hint the engine the request will be routed to, if it already holds the adapter (one
        that does not gets it uploaded, and loaded, on the request's way)."""
        first = next(iter(route(self._endpoints, adapter_key(digest))), None)
        if first is not None and digest in first.adapters and not first.is_down(time.monotonic()):
            self._channel(first).prefetch(digest)

    async def retire_adapter(self, digest: str) -> None:
        """Retire on every engine; one that does not answer is sent the retire before it is used
        again. This client uploads `digest` nowhere any more."""
        self._folders.pop(digest, None)

        async def retire(endpoint: Endpoint) -> None:
            endpoint.adapters.discard(digest)
            try:
                await self._channel(endpoint).call("retire", CALL_SECONDS, digest=digest)
            except EngineStoppedError:
                self._admission.owe_retire(endpoint, digest)
                log.warning("could not retire adapter %s on %s yet", digest, endpoint.url)

        await asyncio.gather(*(retire(e) for e in self._endpoints))

    async def stats(self) -> list[EngineStats | None]:
        """Each engine's EngineStats in LORAMUX_ENGINE_URLS order, None where one does not
        answer (and fresh loads for routing)."""
        return list(await asyncio.gather(*(self._stats_of(e) for e in self._endpoints)))

    async def metrics(self) -> dict[str, str | None]:
        """The Prometheus text of each engine by its index in LORAMUX_ENGINE_URLS; None where
        one does not answer."""

        async def of(endpoint: Endpoint) -> str | None:
            try:
                await self._admission.admit(endpoint)
                return str(await self._channel(endpoint).call("metrics", PROBE_SECONDS))
            except EngineError:
                return None

        texts = await asyncio.gather(*(of(e) for e in self._endpoints))
        return {str(index): text for index, text in enumerate(texts)}

    async def ready(self) -> bool:
        """At least one engine answers."""
        return any(s is not None for s in await self.stats())

    # -- routing and failover ------------------------------------------------------------------
    async def _on_engine(
        self,
        key: str,
        digest: str | None,
        call: Callable[[Endpoint], Awaitable[T]],
        abandoned: Callable[[], bool] = lambda: False,
    ) -> T:
        """`call` on the engine routing picks for `key`, admitted and with `digest` present
        there; the next engine in route order while one is unreachable, stopped, overloaded or
        refused, unless the caller has `abandoned()` the call meanwhile (its error is raised
        then)."""
        self._refresh_loads_soon()
        error: EngineError = EngineStoppedError("no engine serves this gateway's model")
        for endpoint in route(self._endpoints, key):
            try:
                await self._admission.admit(endpoint)
                return await self._with_adapter(endpoint, digest, call)
            except (EngineStoppedError, EngineOverloadedError, EngineVersionError) as exc:
                error = exc
                if abandoned():
                    break
                log.warning("engine %s refused or failed (%s); trying the next", endpoint.url, exc)
        raise error

    async def _with_adapter(
        self, endpoint: Endpoint, digest: str | None, call: Callable[[Endpoint], Awaitable[T]]
    ) -> T:
        if digest is None:
            return await call(endpoint)
        await self._upload(endpoint, digest)
        try:
            return await call(endpoint)
        except UnknownAdapterError:
            if digest not in self._folders:
                raise
            endpoint.adapters.discard(digest)  # the engine restarted and lost it
            await self._upload(endpoint, digest)
            return await call(endpoint)

    async def _upload(self, endpoint: Endpoint, digest: str) -> None:
        """Give `endpoint` the adapter's files unless it is known to hold them (or this client
        has no files for it: then the engine alone decides whether it knows the digest)."""
        folder = self._folders.get(digest)
        if folder is None or digest in endpoint.adapters:
            return
        async with self._upload_locks.setdefault(digest, asyncio.Lock()):
            if digest in endpoint.adapters:
                return
            channel = self._channel(endpoint)
            await send_adapter(
                channel, digest, folder, self._part_bytes, self._folders.__contains__
            )
            endpoint.adapters.add(digest)

    def _refresh_loads_soon(self) -> None:
        """With several engines, refresh their loads in the background when they are stale;
        routing never waits for it."""
        now = time.monotonic()
        if len(self._endpoints) < 2 or now - self._loads_at < LOAD_REFRESH_SECONDS:
            return
        if self._refresh is None or self._refresh.done():
            self._loads_at = now
            self._refresh = asyncio.create_task(self.stats())

    async def _stats_of(self, endpoint: Endpoint) -> EngineStats | None:
        """None while the engine does not answer, or is refused."""
        try:
            await self._admission.admit(endpoint)
            body = await self._channel(endpoint).call("stats", PROBE_SECONDS)
        except EngineError:
            return None
        stats = EngineStats(**body)
        endpoint.load = stats.running + stats.waiting
        endpoint.down_until = 0.0
        return stats


@dataclass
class _Serving:
    """The channel of the engine that has one request (None until it was sent to one), and
    whether it was aborted."""

    channel: Channel | None = None
    aborted: bool = False


def _wire_params(params: SamplingParams) -> SamplingParams:
    """`params` within msgpack's 64-bit integers, meaning the same: the seed folded into the
    generator's range as the engine would, top_k capped (past the vocabulary it keeps all),
    logit_bias ids capped (past the vocabulary the engine refuses them all the same)."""
    bias = tuple((min(t, MAX_WIRE_INT), b) for t, b in params.logit_bias)
    return replace(
        params, seed=params.seed_bits, top_k=min(params.top_k, MAX_WIRE_INT), logit_bias=bias
    )
