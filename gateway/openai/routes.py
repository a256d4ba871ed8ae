"""Thin handlers for the OpenAI-compatible routes; the rules live in `service`.

`openai_router` checks the caller's API key in its guard, before a body is read, and provides
the caller in the connection's state (`caller(request)` reads it); bodies are checked and decoded
by `CompletionRequestBody`. Each handler takes one dependency: Litestar resolves two or more in
an anyio task group on every request, a tenth of a millisecond for values already at hand."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any

from litestar import Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.handlers import BaseRouteHandler
from litestar.openapi.spec import Example, OpenAPIMediaType, Operation, Reference, Schema
from litestar.params import Body, FromPath
from litestar.response import Stream
from litestar.types import ASGIApp, Receive, Scope, Send

from loramux.gateway import tracing
from loramux.gateway.api_docs import errors
from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.errors import ClientClosedRequest
from loramux.gateway.metrics.routes import ARRIVED
from loramux.gateway.openai.body import CompletionRequestBody
from loramux.gateway.openai.finish import Metering
from loramux.gateway.openai.generation import Generation
from loramux.gateway.openai.logprobs import TokenPieces
from loramux.gateway.openai.models import ModelDirectory
from loramux.gateway.openai.prepared import ServingLimits
from loramux.gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from loramux.gateway.openai.service import CompletionService
from loramux.gateway.openai.shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    Model,
    ModelList,
    TextCompletion,
)
from loramux.gateway.openai.tools import tool_call_format
from loramux.gateway.state import GatewayState
from loramux.gateway.usage.outcomes import METERED, record_unmetered

Completions = NamedDependency[CompletionService]
Models = NamedDependency[ModelDirectory]
PRINCIPAL = "principal"
"""Where the guard leaves the caller, in the connection's state."""
RUN = "run"
"""Where a completion leaves its engine run (a Generation), in the connection's state."""
RESOLVED = "resolved_model"
"""Where a completion leaves the model it resolved to (a ResolvedModel), in the connection's
state: a refusal after it is recorded under that model."""
HIT = "hit"
"""Where a completion answered from the response cache leaves how to end it (meter and settle
it), in the connection's state."""

COMPLETION_ERRORS = errors(400, 401, 403, 404, 413, 415, 429, 503, 504)


@dataclass
class JsonOrEventStream(Operation):
    """The operation of a handler annotated `Response[Whole | Chunk]` (or `Response[Whole]`
    when chunks have the whole's shape): the whole response is `application/json`, the chunks
    of `stream: true` are `text/event-stream` events (`data: <chunk>`, then `data: [DONE]`)."""

    def __post_init__(self) -> None:
        assert self.responses is not None
        ok = self.responses["200"]
        assert not isinstance(ok, Reference) and ok.content is not None
        whole = chunk = ok.content["application/json"].schema
        if isinstance(whole, Schema) and whole.one_of:
            whole, chunk = whole.one_of
        ok.content = {
            "application/json": OpenAPIMediaType(schema=whole),
            "text/event-stream": OpenAPIMediaType(schema=chunk),
        }


def caller(connection: ASGIConnection[Any, Any, Any, Any]) -> Principal:
    """The caller whose key the router's guard checked."""
    principal: Principal = connection.state[PRINCIPAL]
    return principal


async def _respond(
    service: CompletionService,
    request: Request[Any, Any, Any],
    body: ChatCompletionRequest | CompletionRequest,
) -> Response[Any]:
    state = request.scope["state"]
    cache_control = request.headers.get("cache-control")
    principal = caller(request)
    model = state[RESOLVED] = await service.resolve(principal, body)
    # A client that leaves while its prompt waits for a tokenizer thread is not tokenized for.
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        prepared = await service.prepare(
            principal, body, model, state["request_id"], state[ARRIVED], cache_control, gone
        )
    finally:
        gone.cancel()
    request.state[METERED] = True
    if (run := service.start(prepared)) is None:
        request.state[HIT] = partial(service.end_hit, prepared)
    elif prepared.stream:
        request.state[RUN] = run
        await _opened(run, request)
    else:
        request.state[RUN] = run
        # One turn of the loop: the run's task sends the request to the engine now, so that
        # its prefill overlaps the start of the response.
        await asyncio.sleep(0)
    headers = prepared.headers()
    if prepared.stream:
        headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return Stream(service.stream(prepared), media_type="text/event-stream", headers=headers)
    whole = await service.complete(prepared, partial(_client_gone, request))
    return Response(whole, media_type="application/json", headers=headers)


async def _opened(run: Generation, request: Request[Any, Any, Any]) -> None:
    """A stream's response starts once its run has had its first output (which its first
    chunk waits for anyway): a run that ended before it, with the engine down, overloaded or
    late, or the request refused there, is answered with its error's status, as a whole
    response is, not with a 200 and an error event. A client that leaves meanwhile gets a 499
    (its run is aborted with the response)."""
    opened = asyncio.ensure_future(run.opened())
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({opened, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        opened.cancel()
        gone.cancel()
    if not opened.done():
        raise ClientClosedRequest("the client closed the connection")
    if run.refused is not None:
        raise run.refused


def end_runs_with_their_response(app: ASGIApp) -> ASGIApp:
    """The router's middleware: a run starts before its response (`CompletionService.start`),
    and whatever becomes of the response (sent to its end, an error, or a client gone before
    its stream was read at all), the run ends with it: aborted if still going. A response that
    was sent to its end waited for its run to end, and aborting an ended run does nothing.
    A cache hit, which has no run, ends with its response likewise: metered and settled
    (`CompletionService.end_hit`), unless its replay to the end already did."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await app(scope, receive, send)
        finally:
            state = scope.get("state", {})
            run: Generation | None = state.get(RUN)
            if run is not None:
                run.abort()
            end_hit: Callable[[], Awaitable[None]] | None = state.get(HIT)
            if end_hit is not None:
                await end_hit()

    return middleware


async def _client_gone(request: Request[Any, Any, Any]) -> None:
    """Returns once the client has closed its connection (the body has been read: the ASGI
    server's next message is `http.disconnect`, sent when the connection is lost)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


_CHAT_EXAMPLE = Example(
    summary="A chat turn on an adapter",
    value={
        "model": "support-bot",
        "messages": [
            {"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "How do I reset my password?"},
        ],
        "max_tokens": 64,
        "temperature": 0.2,
    },
)
_COMPLETION_EXAMPLE = Example(
    summary="A raw prompt on the base model",
    value={"model": "base", "prompt": "def fibonacci(n):", "max_tokens": 32, "stop": ["\n\n"]},
)


@post(
    "/chat/completions",
    status_code=200,
    request_class=CompletionRequestBody,
    operation_class=JsonOrEventStream,
    responses=COMPLETION_ERRORS,
)
async def chat_completions(
    request: Request[Any, Any, Any],
    data: Annotated[ChatCompletionRequest, Body(examples=[_CHAT_EXAMPLE])],
    completions: Completions,
) -> Response[ChatCompletion | ChatCompletionChunk]:
    """OpenAI chat completions; `model` is an adapter name, `owner/name`, or the base model id."""
    return await _respond(completions, request, data)


@post(
    "/completions",
    status_code=200,
    request_class=CompletionRequestBody,
    operation_class=JsonOrEventStream,
    responses=COMPLETION_ERRORS,
)
async def completions(
    request: Request[Any, Any, Any],
    data: Annotated[CompletionRequest, Body(examples=[_COMPLETION_EXAMPLE])],
    completions: Completions,
) -> Response[TextCompletion]:
    """OpenAI text completions for a raw prompt."""
    return await _respond(completions, request, data)


@get("/models", responses=errors(401, 503))
async def list_models(request: Request[Any, Any, Any], models: Models) -> ModelList:
    """The base model and every adapter this key may use (own adapters first; a shared adapter
    shadowed by an own one of the same name is listed as `shared/<name>`)."""
    return await models.list(caller(request))


@get("/models/{model:path}", responses=errors(400, 401, 404, 503))
async def retrieve_model(
    request: Request[Any, Any, Any], model: FromPath[str], models: Models
) -> Model:
    """The model a completion naming it is served by: one of the list, `shared/<name>`,
    `owner/name` (by tenant name or id) and `name@version` included; 404 for a model this key
    may not use, as for one that does not exist."""
    return await models.get(caller(request), model.removeprefix("/"))


def openai_router(gw: GatewayState) -> Router:
    """/v1: the completion routes and the model list, behind the API-key guard."""

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        authorization = connection.headers.get("authorization")
        with tracing.step("auth"):
            connection.state[PRINCIPAL] = await gw.keys.authenticate(authorization)

    completion_service = completion_service_of(gw)
    model_directory = ModelDirectory(gw.catalog, gw.model_name)
    return Router(
        "/v1",
        route_handlers=[chat_completions, completions, list_models, retrieve_model],
        guards=[guard],
        dependencies={
            "completions": Provide(
                lambda: completion_service, sync_to_thread=False, use_cache=True
            ),
            "models": Provide(lambda: model_directory, sync_to_thread=False, use_cache=True),
        },
        middleware=[
            record_unmetered(gw.usage, PRINCIPAL, RESOLVED),
            end_runs_with_their_response,
        ],
    )


def completion_service_of(gw: GatewayState) -> CompletionService:
    """The completion service composed from the process's state."""
    limits = ServingLimits(
        base_model=gw.model_name,
        max_model_len=gw.max_model_len,
        vocab_size=gw.prompts.vocab_size,
        default_max_tokens=gw.settings.server.default_max_tokens,
        identity=gw.identity,
    )
    return CompletionService(
        engine=gw.engine,
        catalog=gw.catalog,
        adapters=gw.store,
        prompts=gw.prompts,
        pieces=TokenPieces(gw.prompts.loop_tokenizer),
        quotas=gw.quotas,
        cache=gw.cache,
        metering=Metering(gw.metrics, gw.usage),
        runs=gw.runs,
        limits=limits,
        tool_format=tool_call_format(gw.prompts.chat_template),
    )
