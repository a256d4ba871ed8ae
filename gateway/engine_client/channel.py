"""One gateway's connection to one engine: a ZeroMQ DEALER socket speaking engine.service.wire.

A receiver task hands each message to the stream or call it answers (by ref). A monitor task
follows the connection: when it drops (the engine died, restarted, or the network failed) every
stream and call waiting on it fails at once with EngineStoppedError, and the endpoint is marked
down; ZeroMQ reconnects by itself. Messages are only queued on a live connection (IMMEDIATE):
while there is none, sending fails after CONNECT_WAIT_SECONDS instead of waiting for an engine
that may never come back. Heartbeats find a peer that vanished without closing its socket.
Over tcp:// with a token the connection runs CURVE (engine.service.curve); a handshake the
engine refuses (another token) is logged, and sends fail as for an unreachable engine.
No frame crosses over its limit (engine.service.wire): a message over the engine's is refused
(invalid_request) before it is sent, since the engine would drop the connection and every
stream on it; the socket takes frames of at most MAX_TO_GATEWAY_BYTES from the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import time
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from loramux.engine.errors import EngineStoppedError, InvalidRequestError
from loramux.engine.service.curve import CurveKeys, secure_gateway, uses_curve
from loramux.engine.service.wire import (
    MAX_FRAME_BYTES,
    MAX_TO_GATEWAY_BYTES,
    Abort,
    Call,
    Delta,
    Failed,
    Op,
    Prefetch,
    Reply,
    ToEngine,
    ToGateway,
    decode_to_gateway,
    encode,
    error_from,
)
from loramux.gateway.engine_client.routing import Endpoint

log = logging.getLogger(__name__)

CONNECT_WAIT_SECONDS = 0.5
"""How long a send waits for a connection before the engine counts as unreachable."""
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 5000
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
REFUSED_LOG_SECONDS = 10.0

StreamItem = Delta | Exception


class StreamSink(Protocol):
    """Where a stream's deltas go as the channel reads them: its queue, or a client's sink."""

    def put_nowait(self, item: StreamItem) -> None: ...


class Channel:
    def __init__(self, context: zmq.asyncio.Context, endpoint: Endpoint, token: str | None):
        self.endpoint = endpoint
        self.token = token or ""
        self.streams: dict[str, StreamSink] = {}
        self._calls: dict[str, asyncio.Future[Any]] = {}
        self._refs = itertools.count()
        self._connected = asyncio.Event()
        self._refused_logged = -REFUSED_LOG_SECONDS
        self.socket = context.socket(zmq.DEALER)
        try:
            self._monitor = self._connect(endpoint.url, token)
        except BaseException:
            # A socket left open keeps its context's term() (the client's close) waiting for good.
            self.socket.close(linger=0)
            raise
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    def _connect(self, url: str, token: str | None) -> zmq.asyncio.Socket:
        """Set the socket's options, start its monitor and connect it to `url`; returns the
        monitor's socket, which is closed again when the connect raises."""
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.IMMEDIATE, 1),
            (zmq.RCVHWM, 0),  # never drop a delta
            (zmq.RECONNECT_IVL, 100),
            (zmq.RECONNECT_IVL_MAX, 1000),
            (zmq.HEARTBEAT_IVL, HEARTBEAT_MS),
            (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
            (zmq.MAXMSGSIZE, MAX_TO_GATEWAY_BYTES),
        ):
            self.socket.setsockopt(option, value)
        if token and uses_curve(url, token):
            secure_gateway(self.socket, CurveKeys.of(token))
        monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
        )
        try:
            self.socket.connect(url)
        except BaseException:
            self.socket.disable_monitor()
            monitor.close(linger=0)
            raise
        return monitor

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._fail_all(EngineStoppedError("the engine client closed"))
        self.socket.disable_monitor()
        self._monitor.close(linger=0)
        self.socket.close(linger=0)

    async def send(self, message: ToEngine) -> None:
        """Queue `message` on the live connection; EngineStoppedError (and the endpoint marked
        down) when there is none; InvalidRequestError when it is over the engine's frame limit."""
        frame = encode(message)
        if len(frame) > MAX_FRAME_BYTES:
            raise InvalidRequestError(
                f"the message to the engine would be {len(frame)} bytes; the engine channel "
                f"carries at most {MAX_FRAME_BYTES}"
            )
        if not self._connected.is_set():
            try:
                await asyncio.wait_for(self._connected.wait(), CONNECT_WAIT_SECONDS)
            except TimeoutError:
                self.endpoint.mark_down()
                raise EngineStoppedError(f"engine {self.endpoint.url} is unreachable") from None
        try:
            await self.socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.endpoint.mark_down()
            raise EngineStoppedError(f"engine {self.endpoint.url} is unreachable") from None

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """Ask the engine to abort `request_id` (or only its choice `choice`), without waiting;
        lost with the connection (and then the engine aborts it by itself when its next delta
        finds no one)."""
        try:
            self.socket.send(encode(Abort(self.token, request_id, choice)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.info("could not abort %s on %s: %s", request_id, self.endpoint.url, exc)

    def abort_upload(self, digest: str) -> None:
        """Tell the engine this gateway gave up its upload of `digest`, without waiting (its
        answer is dropped): it frees the upload's share at once instead of after the engine's
        abandonment timeout. Lost with the connection (the engine then drops it in time)."""
        call = Call(self.token, str(next(self._refs)), "abort-upload", digest=digest)
        try:
            self.socket.send(encode(call), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.info("could not abort the upload of %s on %s: %s", digest, self.endpoint.url, exc)

    def prefetch(self, digest: str) -> None:
        """Hint the engine to start loading adapter `digest`, without waiting; dropped when the
        socket cannot take it at once."""
        try:
            self.socket.send(encode(Prefetch(self.token, digest)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.info("could not hint %s to %s: %s", digest[:12], self.endpoint.url, exc)

    async def call(self, op: Op, timeout: float, **fields: Any) -> Any:
        """The engine's answer to `op`; its typed error when it refused. No answer in `timeout`
        seconds: EngineStoppedError, and the endpoint is marked down."""
        ref = str(next(self._refs))
        answer = self._calls[ref] = asyncio.get_running_loop().create_future()
        try:
            await self.send(Call(self.token, ref, op, **fields))
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns an answer that
            # lands in the turn its caller is cancelled, and the cancel is lost
            async with asyncio.timeout(timeout):
                return await answer
        except TimeoutError:
            self.endpoint.mark_down()
            raise EngineStoppedError(f"engine {self.endpoint.url} did not answer {op}") from None
        finally:
            self._calls.pop(ref, None)
            if answer.done() and not answer.cancelled():
                answer.exception()  # seen: a connection lost while the send waited is its error

    async def _receive(self) -> None:
        while True:
            frame = await self.socket.recv()
            try:
                messages = decode_to_gateway(frame)
            except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # not UTF-8, deep
                log.error("engine %s sent a malformed message: %s", self.endpoint.url, exc)
                continue
            for message in messages:  # a batch: every stream's deltas of an engine step
                self._dispatch(message)

    def _dispatch(self, message: ToGateway) -> None:
        if isinstance(message, Reply):
            self._answer(message.ref, message.value)
        elif isinstance(message, Failed) and message.call:
            self._answer(message.ref, error_from(message))
        else:
            stream = self.streams.get(message.ref)
            if stream is not None:
                item = error_from(message) if isinstance(message, Failed) else message
                stream.put_nowait(item)

    def _answer(self, ref: str, value: Any) -> None:
        answer = self._calls.get(ref)
        if answer is None or answer.done():
            return
        if isinstance(value, Exception):
            answer.set_exception(value)
        else:
            answer.set_result(value)

    async def _watch(self) -> None:
        while True:
            frames = await self._monitor.recv_multipart()
            (event,) = struct.unpack("=H", frames[0][:2])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected.set()
                continue
            if event & HANDSHAKE_FAILED:  # no connection was made: nothing to fail
                self._refused()
                continue
            if not self._connected.is_set():  # the end of a connection never made
                continue
            self._connected.clear()
            self.endpoint.mark_down()
            log.warning("lost the connection to engine %s", self.endpoint.url)
            self._fail_all(EngineStoppedError(f"lost the connection to engine {self.endpoint.url}"))

    def _refused(self) -> None:
        """The handshake failed: tried again every second, logged at most every
        REFUSED_LOG_SECONDS."""
        self.endpoint.mark_down()
        now = time.monotonic()
        if now - self._refused_logged >= REFUSED_LOG_SECONDS:
            self._refused_logged = now
            log.error(
                "engine %s refused the connection's handshake: is LORAMUX_ENGINE_TOKEN the same "
                "on the engine and this gateway?",
                self.endpoint.url,
            )

    def _fail_all(self, error: EngineStoppedError) -> None:
        for stream in self.streams.values():
            stream.put_nowait(error)
        for answer in self._calls.values():
            if not answer.done():
                answer.set_exception(error)
