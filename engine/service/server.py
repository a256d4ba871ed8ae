"""The engine end of the channel: one ROUTER socket serving an AsyncEngine to any number of
gateways (see engine.service.wire for the messages).

Each Generate runs as a task that forwards the engine's deltas to the gateway that asked. A
step's deltas reach the event loop together (engine.async_engine), so the tasks post them to an
outbox in the same turn of the loop, and one flush after them sends each gateway one Batch
frame: one send per gateway per step, not one per request.

The engine tells gateways apart by their ZeroMQ routing id, and the socket refuses to queue for a
routing id that is gone (ROUTER_MANDATORY): when a gateway disconnects or dies, the next batch for
it fails to send, and each of its requests is aborted at its next delta, which frees its KV blocks
and adapter pin. A gateway that reconnects gets a new routing id, so its old streams end too. A
gateway cut off without its connection closing (a network partition, a host gone) misses the
socket's heartbeats and is disconnected the same way. Nothing the engine sends waits on a
reader: at most SEND_QUEUE messages wait for a gateway that stopped reading, the requests whose
outputs a full queue lost are ended, and the gateway is told (`request_failed`) once it reads
again. Only the gateway that started a request can abort it.

No message stops the server: one that is not a message, or not one of ours, is dropped (and
logged, at most once per LOG_EVERY_SECONDS); one whose token is wrong is refused, having been
read no further than its head; one that passes the token but not validation is answered
with `invalid_request`. No frame over MAX_FRAME_BYTES is taken (ZeroMQ drops the connection
at its head; adapters arrive in parts, engine.service.upload_parts), a CURVE handshake's frames
included, and a connection whose handshake is not done in HANDSHAKE_MS is closed: what a peer
without a key can make the engine hold is one such frame per connection, that long.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import EngineStoppedError, InvalidRequestError
from loramux.engine.identity import engine_build
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.service.curve import (
    CurveKeys,
    refuse_open_listener,
    secure_engine,
    uses_curve,
)
from loramux.engine.service.uploads import MAX_ADAPTER_MB, UploadedAdapters
from loramux.engine.service.wire import (
    MAX_FRAME_BYTES,
    WIRE_VERSION,
    Abort,
    Batch,
    Call,
    Delta,
    Failed,
    Generate,
    Prefetch,
    Reply,
    ToGateway,
    UnauthorizedError,
    decode_head,
    decode_to_engine,
    encode,
    failure,
)

log = logging.getLogger(__name__)

REFUSED = frozenset({"generate", "abort", "call"})
"""Kinds of message answered when their token is wrong (a Prefetch is a hint: never answered)."""

HANDSHAKE_MS = 5000
"""A connection that has not completed its handshake (CURVE over tcp://) in this long is closed:
ZeroMQ's default, 30 s, let a peer without a key hold a descriptor, and what it sent of a
handshake frame (up to MAX_FRAME_BYTES), that long per connection."""
SEND_QUEUE = 10_000
"""Messages queued for one gateway at most (a batch per step): past them it is not reading."""
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 5000
"""As gateways' sockets (gateway.engine_client.channel): a gateway silent for 5 s is gone."""
LOG_EVERY_SECONDS = 10.0
OWED_RETRY_SECONDS = 0.5
"""How often a gateway whose queue was full is offered the news of the requests it lost."""
OWED_MAX, OWED_CHUNK = 10_000, 500
"""Lost requests remembered per gateway at most (past them it learns by its own timeouts), and
told per frame."""


@dataclass
class EngineServer:
    engine: AsyncEngine
    model_name: str
    token: str | None
    adapter_dir: Path | None = None
    """Uploaded adapters are stored here (engine.service.uploads: emptied at start); a
    temporary folder, removed by `close`, when None."""
    max_adapter_mb: int = MAX_ADAPTER_MB
    """The largest adapter (config and weights) a gateway may upload (in parts)."""
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS
    """A gateway silent this long is gone (heartbeats every fifth of it, at most 1 s apart)."""
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.uploads = UploadedAdapters(self.engine, self.adapter_dir, self.max_adapter_mb)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        timeout = self.heartbeat_timeout_ms
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, min(HEARTBEAT_MS, max(1, timeout // 5)))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
        self._authenticator: AsyncioAuthenticator | None = None
        self._outbox: dict[bytes, list[Delta | Failed]] = {}
        self._owners: dict[str, bytes] = {}
        """The gateway (routing id) of each request under way: the only one that may abort it."""
        self._dropped = _Dropped()
        self._flush_due = False
        self._streams_of: Counter[bytes] = Counter()
        """Streams under way per gateway (routing id)."""
        self._unreachable: set[bytes] = set()
        """Gateways with streams under way that a batch failed to reach."""
        self._owed: dict[bytes, set[str]] = {}
        """Per gateway, the requests whose outputs its full send queue lost: they are ended,
        and the gateway is told (`_tell_owed`) once it takes messages again."""

    def bind(self, address: str) -> str:
        """Listen on `address` (`ipc://…` or `tcp://host:port`, port 0 or `*` for any); the
        address bound. tcp:// with a token runs CURVE (engine.service.curve); tcp:// beyond
        this host without a token is refused (ValueError). Call on the serving event loop."""
        refuse_open_listener(address, self.token)
        if self.token and uses_curve(address, self.token):
            self._authenticator = secure_engine(self._socket, CurveKeys.of(self.token))
        self._socket.bind(address)
        return str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))

    async def serve(self) -> None:
        """Answer messages until cancelled."""
        self.uploads.start()
        while True:
            frames = await self._socket.recv_multipart(copy=True)
            if len(frames) != 2:  # routing id and one frame, from a DEALER; a REQ sends 3
                self._dropped.note(f"a message of {len(frames) - 1} parts")
                continue
            try:
                self._handle(*frames)
            except Exception:
                log.exception("could not handle a message")

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._socket.close(linger=0)
        self._context.term()
        self.uploads.close()

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            head = decode_head(frame)
        except InvalidRequestError as exc:
            self._dropped.note(str(exc))
            return
        if not self._authorized(head.token):
            if head.kind in REFUSED:  # a hint is never answered
                refused = UnauthorizedError("missing or wrong engine token")
                self._reply(identity, failure(head.ref, head.kind == "call", refused))
            return
        try:
            message = decode_to_engine(frame)
        except InvalidRequestError as exc:
            if head.kind in ("generate", "call"):  # its gateway waits for an answer
                self._reply(identity, failure(head.ref, head.kind == "call", exc))
            else:
                self._dropped.note(str(exc))
            return
        if isinstance(message, Prefetch):
            self.engine.prefetch_adapter(message.digest)
        elif isinstance(message, Generate) and identity in self._owed:
            self._owe(identity, {message.request_id})  # not reading: not run, told later
        elif isinstance(message, Generate):
            owner = self._owners.setdefault(message.request_id, identity) is identity
            self._spawn(self._stream(identity, message, owner))
        elif isinstance(message, Abort):
            if self._owners.get(message.request_id) == identity:  # only its own gateway's
                # As a task, so it runs after the streams spawned before it have added their
                # requests: an abort read in one go with its generate must find the request.
                self._spawn(self._abort(message.request_id, message.choice))
        else:
            self._spawn(self._answer(identity, message))

    def _reply(self, identity: bytes, message: Failed | None) -> None:
        self._spawn(self._send(identity, message))

    async def _abort(self, request_id: str, choice: int | None) -> None:
        self.engine.abort(request_id, choice)

    def _authorized(self, given: str) -> bool:
        return self.token is None or hmac.compare_digest(given.encode(), self.token.encode())

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, identity: bytes, message: ToGateway | Batch | None) -> bool:
        """False when the gateway is gone, or its send queue full (it is not reading)."""
        return await self._sent(identity, message) == "sent"

    async def _sent(
        self, identity: bytes, message: ToGateway | Batch | None
    ) -> Literal["sent", "gone", "full"]:
        assert message is not None
        try:
            await self._socket.send_multipart([identity, encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return "gone"
            if exc.errno == zmq.EAGAIN:
                return "full"
            raise
        return "sent"

    async def _stream(self, identity: bytes, message: Generate, owner: bool) -> None:
        """The request's outputs to its gateway. `owner`: this stream holds the request id for
        its gateway (False for a duplicate of an id under way, which the engine refuses)."""
        try:
            await self._forward(identity, message)
        finally:
            if owner:
                del self._owners[message.request_id]

    async def _forward(self, identity: bytes, message: Generate) -> None:
        request = EngineRequest(
            message.request_id,
            message.params,
            prompt_token_ids=message.prompt_token_ids,
            adapter=message.adapter,
            cache_salt=message.cache_salt,
            owner=message.owner,
        )
        outputs: AsyncIterator[RequestOutput] = self.engine.generate(request)
        self._streams_of[identity] += 1
        try:
            async for out in outputs:
                delta = Delta(
                    out.request_id,
                    out.token_ids,
                    out.finish_reason,
                    out.usage,
                    out.index,
                    out.logprobs,
                    out.timings,
                )
                if not self._post(identity, delta):
                    log.info("gateway of %s left; aborting it", out.request_id)
                    return
        except Exception as exc:
            known = failure(message.request_id, False, exc)
            if known is None:
                log.exception("request %s failed", message.request_id)
                known = Failed(message.request_id, False, "engine", "internal_error", repr(exc))
            self._post(identity, known)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]  # aborts an unfinished one
            self._streams_of[identity] -= 1
            if not self._streams_of[identity]:
                del self._streams_of[identity]
                self._unreachable.discard(identity)

    def _post(self, identity: bytes, message: Delta | Failed) -> bool:
        """Queue a stream's message for the gateway's next batch; False when a batch already
        failed to reach that gateway (it is gone)."""
        if identity in self._unreachable or message.ref in self._owed.get(identity, ()):
            return False
        self._outbox.setdefault(identity, []).append(message)
        if not self._flush_due:
            self._flush_due = True
            self._spawn(self._flush())  # runs after the tasks woken in this turn have posted
        return True

    async def _flush(self) -> None:
        """Send each gateway its batch. A gateway that a batch cannot reach is gone: its streams
        end (and their requests are aborted) at their next delta. A batch lost to a full queue
        ends the streams it carried the same way, and the gateway is told later."""
        self._flush_due = False
        outbox, self._outbox = self._outbox, {}
        for identity, messages in outbox.items():
            try:
                outcome = await self._sent(identity, Batch(messages))
            except zmq.ZMQError as exc:
                log.error("could not send a gateway %d stream messages: %s", len(messages), exc)
                outcome = "gone"
            if outcome == "gone" and identity in self._streams_of:
                self._unreachable.add(identity)
            elif outcome == "full":
                self._owe(identity, {m.ref for m in messages})

    def _owe(self, identity: bytes, refs: set[str]) -> None:
        """End the requests of `refs` (aborted now; their streams end at their next message)
        and owe their gateway the news."""
        owed = self._owed.setdefault(identity, set())
        if not owed:
            log.warning("a gateway is not reading (%d messages queued for it)", SEND_QUEUE)
            self._spawn(self._tell_owed(identity))
        owed.update(list(refs)[: max(0, OWED_MAX - len(owed))])
        for ref in refs:
            if self._owners.get(ref) == identity:
                self.engine.abort(ref)

    async def _tell_owed(self, identity: bytes) -> None:
        """Once the gateway takes messages again, each request whose outputs were lost gets a
        Failed (its stream at the gateway ends with an error, instead of waiting forever), a
        frame of OWED_CHUNK at a time; given up when the gateway is gone. Meanwhile its new
        requests are not run (they join the news)."""
        owed = self._owed[identity]
        message = "the engine dropped this request: its gateway stopped reading its outputs"
        while owed:
            await asyncio.sleep(OWED_RETRY_SECONDS)
            while owed:
                refs = [owed.pop() for _ in range(min(len(owed), OWED_CHUNK))]
                failed: list[Delta | Failed] = [
                    Failed(ref, False, "engine", "request_failed", message) for ref in refs
                ]
                outcome = await self._sent(identity, Batch(failed))
                if outcome == "gone":
                    owed.clear()
                elif outcome == "full":
                    owed.update(refs)
                    break
        del self._owed[identity]

    async def _answer(self, identity: bytes, call: Call) -> None:
        try:
            reply: ToGateway = Reply(call.ref, await self._call(identity, call))
        except Exception as exc:
            known = failure(call.ref, True, exc)
            if known is None:
                log.exception("%s failed", call.op)
                known = Failed(call.ref, True, "engine", "internal_error", repr(exc))
            reply = known
        await self._send(identity, reply)

    async def _call(self, identity: bytes, call: Call) -> Any:
        engine = self.engine
        if call.op == "info":
            llm = engine.engine
            return {
                "model_name": self.model_name,
                "max_model_len": llm.max_model_len,
                "vocab_size": llm.model_config.vocab_size,
                "wire": WIRE_VERSION,
                "model_identity": llm.model_identity,
                "build": engine_build(),
                "max_adapter_bytes": self.uploads.max_adapter_bytes,
            }
        if call.op == "stats":  # what gateways probe: an engine that serves nothing is down
            if engine.health != "ok":
                raise EngineStoppedError(f"the engine's step loop is {engine.health}")
            return asdict(engine.stats())
        if call.op == "metrics":
            return engine.engine.metrics.render()
        if call.op == "adapters":
            return self.served_digests()
        if call.digest is None:
            raise InvalidRequestError(f"{call.op} needs a digest")
        if call.op == "retire":
            return self.uploads.retire(call.digest)
        if call.op == "abort-upload":
            self.uploads.parts.abort(identity, call.digest)
            return True
        if call.weights is None or call.size is None:
            raise InvalidRequestError("register-part needs a part of the weights and their size")
        return await self.uploads.receive_part(
            identity, call.digest, call.config, call.weights, call.offset, call.size
        )

    def served_digests(self) -> list[str]:
        lora = self.engine.engine.lora
        if lora is None:
            return []
        return sorted(d for d in self.engine.adapter_stats() if lora.is_servable(d))


class _Dropped:
    """Messages dropped unanswered, logged at most once per LOG_EVERY_SECONDS: a peer sending
    garbage cannot flood the log."""

    def __init__(self) -> None:
        self._count = 0
        self._logged = -LOG_EVERY_SECONDS

    def note(self, why: str) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_SECONDS:
            log.warning("dropped %d malformed message(s); the last: %s", self._count, why[:500])
            self._count, self._logged = 0, now
