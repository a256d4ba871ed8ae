"""The engine's internal HTTP service: the AsyncEngine facade over HTTP, for remote gateways.

    POST   /generate           EngineRequest → NDJSON stream of RequestOutput deltas
    POST   /abort/{request_id} stop a request: its /generate stream ends with the final output
    POST   /count_tokens       EngineRequest → {"prompt_tokens": n}
    POST   /adapters           multipart: digest, adapter_config, adapter_model → register
    GET    /adapters           {"digests": [...]}: the adapters this engine serves
    DELETE /adapters/{digest}  retire: new requests refused, in-flight ones finish
    GET    /info               {"model_name", "max_model_len", "vocab_size"}
    GET    /stats              EngineStats
    GET    /health             200 while the step loop runs, 503 otherwise (never needs the token)

Typed errors are raised before a stream starts and answered as one JSON error body (see
`engine.service.wire`). A client that disconnects mid-stream closes the engine's generator,
which aborts the sequence and frees its KV blocks. The app owns the engine: it starts it on
startup and shuts it down on shutdown.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import shutil
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.connection import ASGIConnection
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath
from litestar.response import Stream
from litestar.types import Guard

from adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from adapters.store import AdapterStore
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.service.wire import (
    TOKEN_HEADER,
    UnauthorizedError,
    decode_request,
    encode,
    error_payload,
    internal_error_payload,
)

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


@dataclass
class EngineService:
    engine: AsyncEngine
    model_name: str
    store: AdapterStore | None
    """Uploaded adapters, content-addressed; None when the engine serves no LoRA."""

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


Service = NamedDependency[EngineService]


@post("/generate", status_code=200)
async def generate(request: Request[Any, Any, Any], service: Service) -> Stream:
    """Typed errors surface while awaiting the first delta, before any byte is sent."""
    stream = service.engine.generate(decode_request(await request.body()))
    first = await anext(stream)
    lines = _ndjson(first, stream)

    async def close() -> None:  # runs after the response, also when the client went away
        await lines.aclose()

    return Stream(lines, media_type=NDJSON, background=BackgroundTask(close))


async def _ndjson(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncGenerator[bytes, None]:
    """Encoded deltas; a failure mid-stream becomes a last error line. Closing this generator
    closes the engine's, which aborts an unfinished sequence."""
    try:
        yield encode(first) + b"\n"
        if not first.finished:
            async for out in rest:
                yield encode(out) + b"\n"
    except Exception as exc:
        log.exception("generation failed mid-stream")
        known = error_payload(exc)
        yield encode(known[1] if known else internal_error_payload(str(exc))) + b"\n"
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


@post("/abort/{request_id:str}", status_code=200)
async def abort(request_id: FromPath[str], service: Service) -> dict[str, bool]:
    """Stop the request; its /generate stream ends with the engine's final output, whose usage
    counts every token generated (an unknown or finished id changes nothing)."""
    service.engine.abort(request_id)
    return {"aborted": True}


@post("/count_tokens", status_code=200)
async def count_tokens(request: Request[Any, Any, Any], service: Service) -> dict[str, int]:
    engine_request = decode_request(await request.body())
    return {"prompt_tokens": len(service.engine.engine.validate(engine_request))}


@post("/adapters", status_code=200)
async def upload_adapter(request: Request[Any, Any, Any], service: Service) -> dict[str, str]:
    form = await request.form()
    digest = form.get("digest")
    config, weights = form.get("adapter_config"), form.get("adapter_model")
    if not isinstance(digest, str):
        raise InvalidRequestError("the form field `digest` is required")
    if not isinstance(config, UploadFile) or not isinstance(weights, UploadFile):
        raise InvalidRequestError("the files `adapter_config` and `adapter_model` are required")
    await service.register(digest, await config.read(), await weights.read())
    return {"digest": digest}


@get("/adapters")
async def list_adapters(service: Service) -> dict[str, list[str]]:
    return {"digests": service.served_digests()}


@delete("/adapters/{digest:str}", status_code=200)
async def retire_adapter(digest: FromPath[str], service: Service) -> dict[str, bool]:
    return {"retired": service.engine.retire_adapter(digest)}


@get("/info")
async def info(service: Service) -> dict[str, Any]:
    llm = service.engine.engine
    return {
        "model_name": service.model_name,
        "max_model_len": llm.max_model_len,
        "vocab_size": llm.model_config.vocab_size,
    }


@get("/stats")
async def stats(service: Service) -> Response[bytes]:
    return Response(encode(service.engine.stats()), media_type="application/json")


@get("/health", opt={"public": True})
async def health(service: Service) -> Response[dict[str, str]]:
    ok = service.engine.running
    return Response({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)


def _handle_error(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    known = error_payload(exc)
    if known is not None:
        return Response(known[1], status_code=known[0])
    if isinstance(exc, HTTPException):
        body = {"error": {"kind": "http", "code": "http_error", "message": exc.detail}}
        return Response(body, status_code=exc.status_code)
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return Response(internal_error_payload("internal error"), status_code=500)


def _token_guard(token: str | None) -> Guard:
    def guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        if token is None or handler.opt.get("public"):
            return
        given = connection.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise UnauthorizedError(f"missing or wrong {TOKEN_HEADER} header")

    return guard


def create_engine_app(
    engine: AsyncEngine,
    model_name: str,
    *,
    adapter_dir: Path | None = None,
    token: str | None = None,
    max_upload_mb: int = 512,
) -> Litestar:
    """The service for `engine`. Uploaded adapters live under `adapter_dir` (a temporary folder,
    removed at shutdown, when None); with `token`, every route but /health needs it."""
    own_dir = adapter_dir is None
    root = Path(tempfile.mkdtemp(prefix="loramux-engine-adapters-")) if own_dir else adapter_dir
    assert root is not None
    store = None
    if engine.engine.lora is not None:
        store = AdapterStore(root, engine.engine.lora.base, engine.engine.lora.limits)
    service = EngineService(engine, model_name, store)

    async def provide_service() -> EngineService:
        return service

    def shutdown() -> None:
        engine.shutdown()
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)

    return Litestar(
        route_handlers=[
            generate,
            abort,
            count_tokens,
            upload_adapter,
            list_adapters,
            retire_adapter,
            info,
            stats,
            health,
        ],
        dependencies={"service": Provide(provide_service)},
        guards=[_token_guard(token)],
        exception_handlers={Exception: _handle_error},
        on_startup=[engine.start],
        on_shutdown=[shutdown],
        request_max_body_size=max_upload_mb << 20,
        openapi_config=None,
        debug=False,
    )
