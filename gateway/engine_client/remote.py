"""The remote engine client: one or more engine services over HTTP (see engine.service).

Each call is routed (gateway.engine_client.routing) and fails over to the next engine while the
chosen one is unreachable, stopped or overloaded; an engine that fails is passed over for a short
while. Typed engine errors come back as the same classes the engine raised. Adapters travel on
demand: `ensure_adapter` remembers the adapter's folder, and an engine that is about to serve a
digest it is not known to hold gets the files first; an engine that answers "unknown adapter"
(it restarted) gets them again, once, and the call is retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineStoppedError,
    UnknownAdapterError,
)
from engine.outputs import EngineRequest, EngineStats, RequestOutput
from engine.service.wire import TOKEN_HEADER, decode_line, encode, error_from
from gateway.engine_client.base import EngineInfo
from gateway.engine_client.routing import Endpoint, adapter_key, affinity_key, route

log = logging.getLogger(__name__)

T = TypeVar("T")

LOAD_REFRESH_SECONDS = 0.5
"""Engine loads (for routing) are refreshed from /stats at most this often."""

_STREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
_CALL_TIMEOUT = httpx.Timeout(connect=5.0, read=30.0, write=30.0, pool=None)
_PROBE_TIMEOUT = httpx.Timeout(connect=2.0, read=2.0, write=2.0, pool=None)
_UPLOAD_TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=300.0, pool=None)
_JSON = {"content-type": "application/json"}


class RemoteEngineClient:
    def __init__(self, urls: list[str], token: str | None = None):
        if not urls:
            raise ValueError("a remote engine client needs at least one engine URL")
        self._endpoints = [Endpoint(url.rstrip("/")) for url in urls]
        self._http = httpx.AsyncClient(
            headers={TOKEN_HEADER: token} if token else {},
            timeout=_CALL_TIMEOUT,
            # Idle connections are dropped before the engine service drops them (60 s).
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=128, keepalive_expiry=30.0
            ),
        )
        self._folders: dict[str, Path] = {}
        """Adapter folders given to `ensure_adapter`, by digest: what can be uploaded."""
        self._upload_locks: dict[str, asyncio.Lock] = {}
        self._serving: dict[str, _Serving] = {}
        """Requests whose `generate` stream is open or opening, by request id."""
        self._loads_at = 0.0
        self._refresh: asyncio.Task[list[EngineStats]] | None = None

    async def start(self) -> None:
        """Learn which adapters each engine already serves (engines that do not answer are
        marked down for now)."""
        await asyncio.gather(*(self._learn_adapters(e) for e in self._endpoints))

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        await self._http.aclose()

    async def info(self) -> EngineInfo:
        async def call(endpoint: Endpoint) -> EngineInfo:
            body = (await self._send(endpoint, "GET", "/info")).json()
            return EngineInfo(body["model_name"], body["max_model_len"], body["vocab_size"])

        return await self._on_engine("info", None, call)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Typed errors are raised before the first delta; closing early closes the HTTP stream,
        which aborts the engine's sequence."""
        body = encode(request)
        serving = self._serving[request.request_id] = _Serving()

        async def open_stream(endpoint: Endpoint) -> httpx.Response:
            response = await self._send(
                endpoint, "POST", "/generate", body, stream=True, timeout=_STREAM_TIMEOUT
            )
            serving.endpoint = endpoint
            return response

        try:
            response = await self._on_engine(affinity_key(request), request.adapter, open_stream)
        except BaseException:
            self._serving.pop(request.request_id, None)
            raise
        try:
            if serving.aborted:
                await self._abort_on(serving, request.request_id)
            async for line in response.aiter_lines():
                out = decode_line(line)
                yield out
                if out.finished:
                    return
        except httpx.TransportError as exc:
            raise EngineStoppedError(f"the engine stream broke: {exc!r}") from exc
        finally:
            self._serving.pop(request.request_id, None)
            await response.aclose()
        raise EngineStoppedError("the engine ended the stream before the request finished")

    async def abort(self, request_id: str) -> None:
        """Ask the engine serving `request_id` to abort it; its stream then ends with the
        engine's final output. A stream still opening is aborted as soon as it opens."""
        serving = self._serving.get(request_id)
        if serving is None or serving.aborted:
            return
        serving.aborted = True
        if serving.endpoint is not None:
            await self._abort_on(serving, request_id)

    async def _abort_on(self, serving: _Serving, request_id: str) -> None:
        assert serving.endpoint is not None
        try:
            await self._send(serving.endpoint, "POST", f"/abort/{request_id}")
        except EngineError as exc:
            # The stream's own end (or its break) still tells what became of the request.
            log.warning("could not abort %s on %s: %s", request_id, serving.endpoint.url, exc)

    async def count_tokens(self, request: EngineRequest) -> int:
        body = encode(request)

        async def call(endpoint: Endpoint) -> int:
            return int(
                (await self._send(endpoint, "POST", "/count_tokens", body)).json()["prompt_tokens"]
            )

        return await self._on_engine(affinity_key(request), request.adapter, call)

    async def ensure_adapter(self, digest: str, folder: Path) -> None:
        """Remember the adapter's files and upload them to its preferred engine if it lacks them."""
        self._folders[digest] = folder

        async def nothing(endpoint: Endpoint) -> None:
            return None

        await self._on_engine(adapter_key(digest), digest, nothing)

    async def retire_adapter(self, digest: str) -> None:
        """Retire on every engine that answers; this client uploads `digest` nowhere any more."""
        self._folders.pop(digest, None)

        async def retire(endpoint: Endpoint) -> None:
            endpoint.adapters.discard(digest)
            try:
                await self._send(endpoint, "DELETE", f"/adapters/{digest}")
            except EngineStoppedError:
                log.warning("could not retire adapter %s on %s", digest, endpoint.url)

        await asyncio.gather(*(retire(e) for e in self._endpoints))

    async def stats(self) -> list[EngineStats]:
        """One EngineStats per engine that answers (and fresh loads for routing)."""
        answers = await asyncio.gather(*(self._stats_of(e) for e in self._endpoints))
        return [s for s in answers if s is not None]

    async def ready(self) -> bool:
        """At least one engine answers /health."""

        async def healthy(endpoint: Endpoint) -> bool:
            try:
                await self._send(endpoint, "GET", "/health", timeout=_PROBE_TIMEOUT)
            except EngineError:
                return False
            return True

        return any(await asyncio.gather(*(healthy(e) for e in self._endpoints)))

    # -- routing and failover ------------------------------------------------------------------
    async def _on_engine(
        self, key: str, digest: str | None, call: Callable[[Endpoint], Awaitable[T]]
    ) -> T:
        """`call` on the engine routing picks for `key`, with `digest` present there; the next
        engine in route order while one is unreachable, stopped or overloaded."""
        self._refresh_loads_soon()
        error: EngineError = EngineStoppedError("no engine is configured")
        for endpoint in route(self._endpoints, key):
            try:
                return await self._with_adapter(endpoint, digest, call)
            except (EngineStoppedError, EngineOverloadedError) as exc:
                log.warning("engine %s refused or failed (%s); trying the next", endpoint.url, exc)
                error = exc
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
            config, weights = await asyncio.to_thread(_read_adapter, folder)
            files = {
                "adapter_config": (CONFIG_FILE, config),
                "adapter_model": (WEIGHTS_FILE, weights),
            }
            await self._send(
                endpoint,
                "POST",
                "/adapters",
                data={"digest": digest},
                files=files,
                timeout=_UPLOAD_TIMEOUT,
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
        try:
            body = (await self._send(endpoint, "GET", "/stats", timeout=_PROBE_TIMEOUT)).json()
        except EngineError:
            return None
        stats = EngineStats(**body)
        endpoint.load = stats.running + stats.waiting
        endpoint.down_until = 0.0
        return stats

    async def _learn_adapters(self, endpoint: Endpoint) -> None:
        try:
            body = (await self._send(endpoint, "GET", "/adapters", timeout=_PROBE_TIMEOUT)).json()
        except EngineError:
            return
        endpoint.adapters.update(body["digests"])

    # -- HTTP ------------------------------------------------------------------------------
    async def _send(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        content: bytes | None = None,
        *,
        stream: bool = False,
        timeout: httpx.Timeout = _CALL_TIMEOUT,
        **kwargs: Any,
    ) -> httpx.Response:
        """The engine's answer; its typed error when it refused. An unreachable or stopped
        engine raises EngineStoppedError and is marked down."""
        headers = _JSON if content is not None else None
        request = self._http.build_request(
            method, endpoint.url + path, content=content, headers=headers, timeout=timeout, **kwargs
        )
        try:
            response = await self._http.send(request, stream=stream)
            if response.is_error:
                await response.aread()
        except httpx.TransportError as exc:
            endpoint.mark_down()
            raise EngineStoppedError(f"engine {endpoint.url} is unreachable: {exc!r}") from exc
        if not response.is_error:
            return response
        await response.aclose()
        error = error_from(_json_or_none(response), response.status_code)
        if isinstance(error, EngineStoppedError):
            endpoint.mark_down()
        raise error


@dataclass
class _Serving:
    """Where one request's stream runs (None while it opens), and whether it was aborted."""

    endpoint: Endpoint | None = None
    aborted: bool = False


def _read_adapter(folder: Path) -> tuple[bytes, bytes]:
    return (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None
