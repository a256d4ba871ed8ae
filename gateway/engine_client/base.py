"""The engine client interface shared by the in-process and remote clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loramux.engine.errors import EngineError
from loramux.engine.outputs import EngineRequest, EngineStats, RequestOutput
from loramux.engine.service.wire import WIRE_VERSION


class EngineTimeoutError(EngineError):
    """The engine gave no first output of a request within the gateway's deadline
    (LORAMUX_ENGINE_FIRST_OUTPUT_SECONDS): it is hung, or too far behind. The request was
    aborted there, and is not tried on another engine, so that no client waits past it."""


class EngineVersionError(EngineError):
    """The engine speaks another version of the engine channel (engine.service.wire's
    WIRE_VERSION): a gateway and an engine from different loramux releases. The gateway does
    not start against it, rather than fail on its first stream."""


def require_wire(url: str, info: dict[str, Any]) -> dict[str, Any]:
    """The `info` reply of engine `url`, unless it speaks another channel version
    (EngineVersionError, naming both)."""
    if info.get("wire") != WIRE_VERSION:
        raise EngineVersionError(
            f"engine {url} speaks engine channel version {info.get('wire', 1)}, "
            f"this gateway version {WIRE_VERSION}: run the same loramux on both"
        )
    return info


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    """The base model's id, as `GET /v1/models` lists it."""
    max_model_len: int
    vocab_size: int
    model_identity: str
    """A digest of the base model's files and dtype (engine.identity.model_identity), as the
    engine computed it from the files it serves: the response cache and system_fingerprint
    tell checkpoints of one name apart by it."""
    build: str
    """A digest of the engine's code (engine.identity.engine_build), for system_fingerprint."""

    @classmethod
    def of(cls, reply: dict[str, Any]) -> EngineInfo:
        """The facts of an engine's `info` reply (the ZeroMQ engine's or a Ray replica's)."""
        return cls(
            reply["model_name"],
            reply["max_model_len"],
            reply["vocab_size"],
            reply["model_identity"],
            reply["build"],
        )


class EngineClient(Protocol):
    """A connection to one or more engines.

    Requests carry their prompt as token ids (`prompt_token_ids`) and outputs carry token ids:
    text is the gateway's business (gateway.prompt_tokens), whichever client runs the engine.

    `generate` raises the engine's typed errors (engine.errors, and EngineTimeoutError) before
    it yields anything, so a refused request never starts a response; once it yields, deltas
    concatenate to the text and the last one carries the finish reason and usage. Closing the iterator early aborts the
    engine's sequence and frees its KV blocks, but what the engine generated after the last
    delta read is then never seen: `abort` is the way to stop a request and still learn it.
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def info(self) -> EngineInfo: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...
    async def stream(self, request: EngineRequest, sink: Callable[[RequestOutput], None]) -> None:
        """`generate`'s outputs handed to `sink` (on the event loop; it must not block), returning
        once the last one was: the same errors, raised before any output or ending the stream.
        A client may push them from where it reads them, waking no task per output."""
        ...

    async def abort(self, request_id: str, choice: int | None = None) -> None:
        """Stop the request `request_id` whose `generate` stream is being read: the stream then
        ends with a final output (finish reason `abort`, unless it finished first) whose usage
        counts every token the engine generated for it, delivered or not. Unknown or finished
        ids are ignored. Call it only once `generate` has been asked for its first output.
        With `choice`, only that choice stops (its final output comes, the stream goes on);
        a client that cannot address one choice may ignore it."""
        ...

    async def ensure_adapter(self, digest: str, folder: Path) -> None:
        """Make the engine(s) serve the adapter whose files are in `folder`, named by `digest`."""
        ...

    def prefetch_adapter(self, digest: str) -> None:
        """Hint the engine that will serve `digest` to start loading it, as a request for it is
        being prepared. Fire and forget: never waits, never fails, may be dropped."""
        ...

    async def retire_adapter(self, digest: str) -> None:
        """New requests for `digest` are refused; in-flight ones finish on it."""
        ...

    async def stats(self) -> list[EngineStats | None]:
        """Each engine's stats, in engine order as `metrics`, None for one that does not answer
        (an empty list: none is known)."""
        ...

    async def metrics(self) -> dict[str, str | None]:
        """Each engine's Prometheus text (engine.metrics) by the label of its series, which no
        other engine ever takes: its index in LORAMUX_ENGINE_URLS (None for one that does not
        answer), or a Ray Serve replica's id."""
        ...

    async def ready(self) -> bool: ...
