"""The engine end of the channel: one ROUTER socket serving an AsyncEngine to any number of
gateways (see engine.service.wire for the messages).

Each Generate runs as a task that forwards the engine's deltas to the gateway that asked. A
step's deltas reach the event loop together (engine.async_engine), so the tasks post them to an
outbox in the same turn of the loop, and one flush after them sends each gateway one Batch
frame: one send per gateway per step, not one per request.

The engine tells gateways apart by their ZeroMQ routing id, and the socket refuses to queue for a
routing id that is gone (ROUTER_MANDATORY): when a gateway disconnects or dies, the next batch for
it fails to send, and each of its requests is aborted at its next delta, which frees its KV blocks
and adapter pin. A gateway that reconnects gets a new routing id, so its old streams end too.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loramux.adapters.store import AdapterStore
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import InvalidRequestError
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.service.wire import (
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
    decode_to_engine,
    encode,
    failure,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_MB = 512
"""Largest message the engine accepts (an adapter upload is one message)."""


@dataclass
class EngineServer:
    engine: AsyncEngine
    model_name: str
    token: str | None
    adapter_dir: Path | None = None
    """Uploaded adapters are stored here; a temporary folder, removed by `close`, when None."""
    max_message_mb: int = MAX_MESSAGE_MB
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._own_dir = self.adapter_dir is None
        if self.adapter_dir is None:
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="loramux-engine-adapters-"))
        lora = self.engine.engine.lora
        self.store = (
            None if lora is None else AdapterStore(self.adapter_dir, lora.base, lora.limits)
        )
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_mb << 20)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)  # deltas are small; never drop or block on them
        self._outbox: dict[bytes, list[Delta | Failed]] = {}
        self._flush_due = False
        self._streams_of: Counter[bytes] = Counter()
        """Streams under way per gateway (routing id)."""
        self._unreachable: set[bytes] = set()
        """Gateways with streams under way that a batch failed to reach."""

    def bind(self, address: str) -> str:
        """Listen on `address` (`ipc://…` or `tcp://host:port`, port 0 or `*` for any); the
        address bound."""
        self._socket.bind(address)
        return str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))

    async def serve(self) -> None:
        """Answer messages until cancelled."""
        while True:
            identity, frame = await self._socket.recv_multipart(copy=True)
            self._handle(identity, frame)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._socket.close(linger=0)
        self._context.term()
        if self._own_dir and self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            message = decode_to_engine(frame)
        except InvalidRequestError as exc:
            log.warning("dropped a malformed message: %s", exc)
            return
        if isinstance(message, Prefetch):
            if self._authorized(message.token):  # nothing is ever answered to a hint
                self.engine.prefetch_adapter(message.digest)
        elif not self._authorized(message.token):
            ref = message.ref if isinstance(message, Call) else message.request_id
            refused = UnauthorizedError("missing or wrong engine token")
            self._spawn(self._send(identity, failure(ref, isinstance(message, Call), refused)))
        elif isinstance(message, Generate):
            self._spawn(self._stream(identity, message))
        elif isinstance(message, Abort):
            # As a task, so it runs after the streams spawned before it have added their
            # requests: an abort read in one go with its generate must find the request there.
            self._spawn(self._abort(message.request_id, message.choice))
        else:
            self._spawn(self._answer(identity, message))

    async def _abort(self, request_id: str, choice: int | None) -> None:
        self.engine.abort(request_id, choice)

    def _authorized(self, given: str) -> bool:
        return self.token is None or hmac.compare_digest(given.encode(), self.token.encode())

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, identity: bytes, message: ToGateway | Batch | None) -> bool:
        """False when the gateway is gone."""
        assert message is not None
        try:
            await self._socket.send_multipart([identity, encode(message)])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    async def _stream(self, identity: bytes, message: Generate) -> None:
        request = EngineRequest(
            message.request_id,
            message.params,
            prompt_token_ids=message.prompt_token_ids,
            adapter=message.adapter,
            cache_salt=message.cache_salt,
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
        if identity in self._unreachable:
            return False
        self._outbox.setdefault(identity, []).append(message)
        if not self._flush_due:
            self._flush_due = True
            self._spawn(self._flush())  # runs after the tasks woken in this turn have posted
        return True

    async def _flush(self) -> None:
        """Send each gateway its batch. A gateway that a batch cannot reach is gone: its streams
        end (and their requests are aborted) at their next delta."""
        self._flush_due = False
        outbox, self._outbox = self._outbox, {}
        for identity, messages in outbox.items():
            try:
                sent = await self._send(identity, Batch(messages))
            except zmq.ZMQError as exc:
                log.error("could not send a gateway %d stream messages: %s", len(messages), exc)
                sent = False
            if not sent and identity in self._streams_of:
                self._unreachable.add(identity)

    async def _answer(self, identity: bytes, call: Call) -> None:
        try:
            reply: ToGateway = Reply(call.ref, await self._call(call))
        except Exception as exc:
            known = failure(call.ref, True, exc)
            if known is None:
                log.exception("%s failed", call.op)
                known = Failed(call.ref, True, "engine", "internal_error", repr(exc))
            reply = known
        await self._send(identity, reply)

    async def _call(self, call: Call) -> Any:
        engine = self.engine
        if call.op == "info":
            llm = engine.engine
            return {
                "model_name": self.model_name,
                "max_model_len": llm.max_model_len,
                "vocab_size": llm.model_config.vocab_size,
                "wire": WIRE_VERSION,
            }
        if call.op == "stats":
            return asdict(engine.stats())
        if call.op == "metrics":
            return engine.engine.metrics.render()
        if call.op == "adapters":
            return self.served_digests()
        if call.digest is None:
            raise InvalidRequestError(f"{call.op} needs a digest")
        if call.op == "retire":
            return engine.retire_adapter(call.digest)
        if call.config is None or call.weights is None:
            raise InvalidRequestError("register needs the adapter's config and weights")
        await self.register(call.digest, call.config, call.weights)
        return call.digest

    async def register(self, digest: str, config: bytes, weights: bytes) -> None:
        """Store the uploaded adapter and serve it; refused unless its content has `digest`.

        A refused upload registers nothing (a valid adapter that merely has another digest
        stays in the content-addressed store, unserved)."""
        if self.store is None:
            raise InvalidRequestError("this engine was started without LoRA support")
        try:
            stored = self.store.get(digest)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if stored is None:
            with tempfile.TemporaryDirectory() as work:  # the store copies what it keeps
                (Path(work) / CONFIG_FILE).write_bytes(config)
                (Path(work) / WEIGHTS_FILE).write_bytes(weights)
                stored = await asyncio.to_thread(self.store.put, Path(work))
        if stored.digest != digest:
            raise InvalidRequestError(
                f"the uploaded adapter has digest {stored.digest}, not {digest!r}"
            )
        await self.engine.register_adapter(stored.path)

    def served_digests(self) -> list[str]:
        lora = self.engine.engine.lora
        if lora is None:
            return []
        return sorted(d for d in self.engine.adapter_stats() if lora.is_servable(d))
