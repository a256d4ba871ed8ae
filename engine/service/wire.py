"""The engine channel's messages: msgpack frames (msgspec) over ZeroMQ, the same on `ipc://`
and `tcp://`.

A gateway holds one DEALER socket per engine; the engine one ROUTER socket. Every message a
gateway sends carries the engine token (LORAMUX_ENGINE_TOKEN; empty when the engine runs
without one) and the engine checks it, in constant time, before it reads anything else: it
first reads only the message's `Head` (kind, token, id), skipping the rest unread, so a peer
without the token costs it no decoding of what it sent.

    gateway → engine                              engine → gateway
    Generate(request_id, prompt_token_ids, …)     Delta(ref=request_id, token_ids, finish, usage,
                                                        index, logprobs)…
    Abort(request_id)                             (the stream's last Delta says `abort`)
    Prefetch(digest)                              nothing: a hint to start loading an adapter

Streams' Deltas and Failed messages travel in Batches: all that one turn of the engine's event
loop has for one gateway (a step's deltas for every request of that gateway) in one frame, in
the order they were made. `decode_to_gateway` unpacks them.

A request with n > 1 choices streams each choice's Deltas (`index`); its stream ends with the
Delta that carries `usage`.
    Call(ref, op, digest, config, weights)        Reply(ref, value)
    any of them, refused                          Failed(ref, call, kind, code, message)

Requests carry token ids and outputs carry token ids: the engine never sees text. `Call.op` is
one of `info`, `stats` (refused, `engine_stopped`, while the step loop has stopped or is
stalled: what gateways probe), `metrics` (the engine's Prometheus text), `adapters` (the
digests it serves), `register-part`, `abort-upload` and `retire`. Every typed error has one
stable `code`, so the client re-raises the same class.

No frame is larger than MAX_FRAME_BYTES (the engine's socket drops a connection that sends
one, and with it every stream of that gateway): an adapter travels as `register-part` calls
of at most UPLOAD_PART_BYTES of its weights each, in order (`offset`, the weights' whole
`size` in each; the config in the first), each answered once stored; the last one's answer
comes once the engine has checked the whole adapter against its digest and serves it. A part
may be answered with the digest before the last one: the engine serves it already (another
gateway's upload of it, which the first part waited for). A gateway that gives an upload up
says so (`abort-upload`, the digest): the engine drops it at once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from loramux.adapters.errors import AdapterError
from loramux.engine.errors import (
    AdapterUnavailableError,
    EngineError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    PromptTooLongError,
    RequestFailedError,
    StructuredOutputFailedError,
    UnknownAdapterError,
)
from loramux.engine.outputs import RequestTimings, TokenLogprob, Usage
from loramux.engine.sampling import SamplingParams
from loramux.engine.structured import StructuredOutputError

WIRE_VERSION = 5
"""This protocol's version, in the engine's `info` reply: a gateway refuses an engine that
speaks another (2: stream messages travel in Batches; 3: an Abort may name one choice; 4:
adapters travel in parts, and no frame is over MAX_FRAME_BYTES; 5: `info` names the base
model's identity and the engine's build, `model_identity` and `build`: engine.identity, and a
Generate names its request's owner, `owner`, by whom the engine shares its full queue)."""

MAX_FRAME_BYTES = 16 << 20
"""The largest frame the engine takes (its socket's ZMQ_MAXMSGSIZE). ZeroMQ reads a CURVE
handshake's frames through the same decoder, before the peer has proven it holds a key: so
this is also what a stranger's connection can make the engine buffer, until the handshake's
deadline. A gateway never sends more: an adapter goes in parts, and a request that would not
fit (a prompt is at most max_model_len token ids) is refused before it is sent."""
UPLOAD_PART_BYTES = 8 << 20
"""The weights a `register-part` carries at most (the first also carries the config, at most
1 MiB): a part's frame fits MAX_FRAME_BYTES with room to spare."""
MAX_TO_GATEWAY_BYTES = 64 << 20
"""The largest frame a gateway takes from an engine (its socket's ZMQ_MAXMSGSIZE): a step's
deltas for every request of that gateway, or a call's reply, are far less; a peer posing as an
engine (at the engine's address) can make a gateway hold at most this per connection, and a
gateway makes one connection per engine."""


class UnauthorizedError(EngineError):
    """The message lacks the engine's token (or carries a wrong one)."""


MAX_ID_CHARS = 256
"""The longest request id, call ref or digest a message may carry (what a refusal echoes)."""
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]


class Head(msgspec.Struct, array_like=True):
    """The first three fields of every message to the engine: its kind (the tag), the token,
    and its id (a Generate's or Abort's request id, a Call's ref, a Prefetch's digest)."""

    kind: str
    token: str
    ref: Id


class Generate(msgspec.Struct, tag="generate", array_like=True):
    token: str
    request_id: Id
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    cache_salt: str | None = None
    owner: Id | None = None
    """Who sent it (`EngineRequest.owner`: the tenant's id); the full queue is shared by owner."""


class Abort(msgspec.Struct, tag="abort", array_like=True):
    token: str
    request_id: Id
    choice: int | None = None
    """Only this choice of the request (a stop string ended it at the gateway); None: all."""


class Prefetch(msgspec.Struct, tag="prefetch", array_like=True):
    """Start reading adapter `digest` from disk: a request for it is on its way (the gateway
    resolved it for that request's tenant). Fire and forget; unknown digests are ignored."""

    token: str
    digest: Id


Op = Literal["info", "stats", "metrics", "adapters", "register-part", "abort-upload", "retire"]
Offset = Annotated[int, msgspec.Meta(ge=0)]


class Call(msgspec.Struct, tag="call", array_like=True):
    token: str
    ref: Id
    op: Op
    digest: str | None = None
    config: bytes | None = None
    """A `register-part`'s adapter config: in the upload's first part only."""
    weights: bytes | None = None
    """A `register-part`'s part of the weights, which start at `offset` of the whole."""
    offset: Offset = 0
    size: Offset | None = None
    """A `register-part`'s whole weights' size, in bytes."""


class Delta(msgspec.Struct, tag="delta", array_like=True):
    ref: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    """Set on the request's last Delta only: the stream ends with it."""
    index: int = 0
    """The choice these tokens belong to."""
    logprobs: list[TokenLogprob] | None = None
    """Aligned with `token_ids`, when the request asked for logprobs."""
    timings: RequestTimings | None = None


class Reply(msgspec.Struct, tag="reply", array_like=True):
    ref: str
    value: Any


class Failed(msgspec.Struct, tag="failed", array_like=True):
    ref: str
    call: bool
    """The ref names a Call (else a Generate's request id)."""
    kind: Literal["engine", "adapter"]
    code: str
    message: str


class Batch(msgspec.Struct, tag="batch", array_like=True):
    """Stream messages for one gateway, in order, in one frame."""

    messages: list[Delta | Failed]


ToEngine = Generate | Abort | Prefetch | Call
ToGateway = Delta | Reply | Failed

_encoder = msgspec.msgpack.Encoder()
_head = msgspec.msgpack.Decoder(Head)
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_to_gateway = msgspec.msgpack.Decoder(ToGateway | Batch)


def encode(message: ToEngine | ToGateway | Batch) -> bytes:
    return _encoder.encode(message)


def decode_head(frame: bytes) -> Head:
    """The message's head, the rest skipped unread; InvalidRequestError when it has none."""
    return _decoded(_head, frame)


def decode_to_engine(frame: bytes) -> ToEngine:
    """The message in `frame`; InvalidRequestError when it is none (bad sampling numbers too)."""
    return _decoded(_to_engine, frame)


def _decoded(decoder: msgspec.msgpack.Decoder[Any], frame: bytes) -> Any:
    """Whatever the bytes: msgpack that is not one (DecodeError), a value of the wrong shape or
    out of bounds (ValidationError, InvalidRequestError from SamplingParams), a string that is
    not UTF-8 (ValueError), nesting past the interpreter's stack (RecursionError)."""
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"malformed message: {exc}") from None


def decode_to_gateway(frame: bytes) -> list[ToGateway]:
    """The messages in `frame`: one, or a Batch's in order."""
    message = _to_gateway.decode(frame)
    return [*message.messages] if isinstance(message, Batch) else [message]


# Subclasses before their bases: the first isinstance match names an error.
ENGINE_ERRORS: tuple[tuple[type[EngineError], str], ...] = (
    (PromptTooLongError, "prompt_too_long"),
    (UnknownAdapterError, "unknown_adapter"),
    (StructuredOutputError, "invalid_structured_output"),
    (InvalidRequestError, "invalid_request"),
    (EngineOverloadedError, "engine_overloaded"),
    (EngineStoppedError, "engine_stopped"),
    (AdapterUnavailableError, "adapter_unavailable"),
    (StructuredOutputFailedError, "structured_output_failed"),
    (RequestFailedError, "request_failed"),
    (UnauthorizedError, "unauthorized"),
)


def failure(ref: str, call: bool, exc: Exception) -> Failed | None:
    """The Failed message for a typed engine or adapter error; None for anything unexpected."""
    if isinstance(exc, AdapterError):
        return Failed(ref, call, "adapter", exc.code, exc.message)
    for cls, code in ENGINE_ERRORS:
        if isinstance(exc, cls):
            return Failed(ref, call, "engine", code, str(exc))
    return None


def error_from(failed: Failed) -> Exception:
    """The exception a Failed message stands for: the same typed class the engine raised."""
    if failed.kind == "adapter":
        return _adapter_error_classes().get(failed.code, AdapterError)(failed.message)
    for cls, code in ENGINE_ERRORS:
        if failed.code == code:
            return cls(failed.message)
    return EngineError(f"engine error {failed.code}: {failed.message}")


def _adapter_error_classes() -> dict[str, type[AdapterError]]:
    found: dict[str, type[AdapterError]] = {}
    pending: list[type[AdapterError]] = [AdapterError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found
