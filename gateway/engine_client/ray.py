"""The engine client over a Ray Serve deployment handle (engine.ray_deployment).

Each request names its adapter digest as the multiplexed model id, so Ray Serve sends it to a
replica that already holds the adapter (and its prefix blocks), or picks one that then loads it
from the shared adapter store. Ray Serve health-checks and restarts replicas; this client only
retries a request whose replica failed before its first output (nothing reached the client yet),
and ends a stream that had started with EngineStoppedError, which the gateway turns into a clean
error event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from loramux.engine.errors import EngineError, EngineStoppedError
from loramux.engine.outputs import EngineRequest, EngineStats, RequestOutput, Usage
from loramux.engine.ray_deployment import BASE_MODEL_ID, ReplicaMetrics, ReplicaStats
from loramux.engine.sequence import FinishReason
from loramux.gateway.engine_client.base import EngineInfo, EngineTimeoutError

log = logging.getLogger(__name__)

START_ATTEMPTS = 3
"""Replicas tried for a request that fails before its first output."""
PROBE_SECONDS = 5.0
"""How long `stats` and `metrics` wait for every replica's answer."""


class RayEngineClient:
    def __init__(
        self, handle: DeploymentHandle, first_output_seconds: float = 60.0, affinity: bool = True
    ):
        self.handle = handle
        self.affinity = affinity
        """False: no multiplexed model id, Ray Serve's default routing (benchmarks compare)."""
        self.first_output_seconds = first_output_seconds
        self._streams: dict[str, _Stream] = {}
        self._opening: dict[str, bool] = {}
        """Requests waiting for their first output, and whether `abort` was asked meanwhile."""

    async def start(self) -> None:
        await self.info()

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.responses.cancel()

    async def info(self) -> EngineInfo:
        answer = await self._call("info")
        return EngineInfo.of(answer)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Typed engine errors are raised before the first output; a replica lost before it is
        replaced by another (START_ATTEMPTS in all), one lost after it ends the stream with
        EngineStoppedError."""
        self._opening[request.request_id] = False
        try:
            stream, first = await self._open(request)
        finally:
            aborted_early = self._opening.pop(request.request_id)
        self._streams[request.request_id] = stream
        if aborted_early:
            await self.abort(request.request_id)
        finished = False
        try:
            out = first
            while True:
                finished = out.usage is not None
                stream.delivered += len(out.token_ids)
                yield out
                if finished:
                    return
                try:
                    following = await _next(stream.responses)
                except EngineStoppedError:
                    if not stream.aborted:
                        raise
                    finished = True
                    yield _aborted(out, stream)
                    return
                if following is None:
                    raise EngineStoppedError("the engine replica ended the stream unfinished")
                out = following
        finally:
            del self._streams[request.request_id]
            if not finished:
                stream.responses.cancel()

    async def _open(self, request: EngineRequest) -> tuple[_Stream, RequestOutput]:
        error: EngineError = EngineStoppedError("no engine replica answered")
        model_id = (request.adapter or BASE_MODEL_ID) if self.affinity else ""
        handle = self.handle.options(stream=True, multiplexed_model_id=model_id)
        for attempt in range(START_ATTEMPTS):
            responses = handle.generate.remote(request)
            assert isinstance(responses, DeploymentResponseGenerator)  # stream=True
            try:
                first = await asyncio.wait_for(_next(responses), self.first_output_seconds)
            except TimeoutError:
                responses.cancel()
                raise EngineTimeoutError(
                    f"no output within {self.first_output_seconds:g} s of request "
                    f"{request.request_id}"
                ) from None
            except EngineStoppedError as exc:
                log.warning(  # its id alone: the request holds what a tenant wrote
                    "engine replica lost before %s started (try %d)",
                    request.request_id,
                    attempt + 1,
                )
                error = exc
                continue
            if first is None:
                error = EngineStoppedError("the engine replica ended the stream before any output")
                continue
            return _Stream(request, responses), first
        raise error

    async def stream(self, request: EngineRequest, sink: Callable[[RequestOutput], None]) -> None:
        async for out in self.generate(request):
            sink(out)

    async def abort(self, request_id: str, choice: int | None = None) -> None:
        """One choice (`choice`): the replica running the stream is asked to stop it (the
        deployment's router sends the call there: engine.ray_deployment.StreamReplicaRouter),
        and the stream goes on with that choice's final output, as on the local engine.

        The whole request: Ray cannot stop a stream from the replica's side before its next
        output, so the stream is cancelled (the replica then aborts the sequence and frees its
        blocks) and ends here with an `abort` output whose usage counts the tokens delivered:
        tokens the engine generated after the last one read are not counted."""
        if choice is not None:
            if request_id in self._streams:  # none opening: a choice ends only once it began
                await self._call("abort", None, request_id, choice)
            return
        if request_id in self._opening:  # asked before its first output: abort once it comes
            self._opening[request_id] = True
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.aborted = True
            stream.responses.cancel()

    async def ensure_adapter(self, digest: str, folder: Path) -> None:
        """Replicas load adapters from the shared store on first use; nothing to push."""

    def prefetch_adapter(self, digest: str) -> None:
        """No hint: which replica serves `digest` is decided when the request is routed, and
        Ray Serve's multiplexing then loads the adapter there (engine.ray_deployment)."""

    async def retire_adapter(self, digest: str) -> None:
        """Nothing to do here: a handle cannot reach every replica. Gateways resolve adapters
        by name, so a deleted one gets no new request on any replica; each replica finds the
        delete itself, within about a second, by asking the shared store which of its adapters
        it still has, and retires the others: in-flight requests finish, then the adapter and
        its files there go (engine.ray_deployment RETIRE_CHECK_SECONDS)."""

    async def stats(self) -> list[EngineStats | None]:
        """Every running replica's stats, by replica id; None for each that failed to answer."""
        answers = await self._every_replica("stats")
        found = sorted((a for a in answers if isinstance(a, ReplicaStats)), key=lambda s: s.replica)
        failed: list[EngineStats | None] = [None for a in answers if isinstance(a, Exception)]
        return [EngineStats(**s.engine) for s in found] + failed

    async def replica_stats(self, digests: list[str] | None = None) -> list[ReplicaStats]:
        """The stats of the replicas reached by one call per digest (each goes to a replica
        that holds it, as Ray Serve routes it), and one call without a digest; one entry per
        replica."""
        calls = [self._call("stats")]
        for digest in digests or []:
            calls.append(self._call("stats", digest))
        found: dict[str, ReplicaStats] = {}
        for s in await asyncio.gather(*calls):
            found[s.replica] = s
        return sorted(found.values(), key=lambda s: s.replica)

    async def metrics(self) -> dict[str, str | None]:
        """Every running replica's Prometheus text, by replica id (a replica started in the
        place of another has its own series: none goes backwards)."""
        answers = await self._every_replica("metrics")
        return {a.replica: a.text for a in answers if isinstance(a, ReplicaMetrics)}

    async def _every_replica(self, method: str) -> list[Any]:
        """`method`'s answer from every running replica (Ray Serve's broadcast), an exception in
        place of one that failed; none when no replica runs or they did not all answer within
        PROBE_SECONDS."""
        try:
            return await self.handle.broadcast(method).results_async(
                timeout_s=PROBE_SECONDS, return_exceptions=True
            )
        except Exception as exc:  # Ray Serve's: no replica is running, or TimeoutError
            log.warning("the engine replicas did not answer %s: %r", method, exc)
            return []

    async def ready(self) -> bool:
        try:
            await self.info()
        except EngineError:
            return False
        return True

    async def _call(self, method: str, model_id: str | None = None, *args: Any) -> Any:
        handle = (
            self.handle if model_id is None else self.handle.options(multiplexed_model_id=model_id)
        )
        try:
            return await getattr(handle, method).remote(*args)
        except EngineError:
            raise
        except RayError as exc:
            raise EngineStoppedError(f"engine replica failed: {exc}") from None


class _Stream:
    def __init__(self, request: EngineRequest, responses: DeploymentResponseGenerator):
        self.request = request
        self.responses = responses
        self.delivered = 0
        self.aborted = False


async def _next(responses: DeploymentResponseGenerator) -> RequestOutput | None:
    """The next output; None at the end; EngineStoppedError when the replica is lost."""
    try:
        out: RequestOutput = await responses.__anext__()
    except StopAsyncIteration:
        return None
    except EngineError:
        raise
    except asyncio.CancelledError:
        if not responses.cancelled():
            raise
        raise EngineStoppedError("the stream was cancelled") from None
    except Exception as exc:  # Ray's and Ray Serve's errors: the replica is gone or refused
        raise EngineStoppedError(f"engine replica lost: {exc!r}") from None
    return out


def _aborted(last: RequestOutput, stream: _Stream) -> RequestOutput:
    prompt = len(stream.request.prompt_token_ids or [])
    return RequestOutput(
        last.request_id,
        [],
        FinishReason.ABORT,
        Usage(prompt, stream.delivered, 0),
    )
