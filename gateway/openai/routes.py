"""Thin handlers for the OpenAI-compatible routes; the rules live in `service`.

`openai_router` checks the caller's API key in its guard, before a body is read, and provides
the caller as `principal`; bodies are checked and decoded by `CompletionRequestBody`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any

from litestar import Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.handlers import BaseRouteHandler
from litestar.openapi.spec import Example, OpenAPIMediaType, Operation, Reference, Schema
from litestar.params import Body
from litestar.response import Stream

from gateway.api_docs import errors
from gateway.auth.api_keys import Principal
from gateway.db.adapter import SHARED_OWNER
from gateway.openai.body import CompletionRequestBody
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.openai.service import CompletionService
from gateway.openai.shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    Model,
    ModelList,
    TextCompletion,
)
from gateway.state import GatewayState
from gateway.usage.outcomes import METERED, record_unmetered

GW = NamedDependency[GatewayState]
Caller = NamedDependency[Principal]
PRINCIPAL = "principal"
"""Where the guard leaves the caller, in the connection's state."""

COMPLETION_ERRORS = errors(400, 401, 403, 404, 413, 415, 429, 503)


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


async def _respond(
    gw: GatewayState,
    request: Request[Any, Any, Any],
    body: ChatCompletionRequest | CompletionRequest,
    principal: Principal,
) -> Response[Any]:
    service = CompletionService(gw)
    request_id = request.scope["state"]["request_id"]
    prepared = await service.prepare(
        principal, body, request_id, request.headers.get("cache-control")
    )
    request.state[METERED] = True
    headers = prepared.headers()
    if prepared.stream:
        headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return Stream(service.stream(prepared), media_type="text/event-stream", headers=headers)
    whole = await service.complete(prepared, partial(_client_gone, request))
    return Response(whole, media_type="application/json", headers=headers)


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
    gw: GW,
    principal: Caller,
) -> Response[ChatCompletion | ChatCompletionChunk]:
    """OpenAI chat completions; `model` is an adapter name, `owner/name`, or the base model id."""
    return await _respond(gw, request, data, principal)


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
    gw: GW,
    principal: Caller,
) -> Response[TextCompletion]:
    """OpenAI text completions for a raw prompt."""
    return await _respond(gw, request, data, principal)


@get("/models", responses=errors(401, 503))
async def list_models(gw: GW, principal: Caller) -> ModelList:
    """The base model and every adapter this key may use (own adapters first; a shared adapter
    shadowed by an own one of the same name is listed as `shared/<name>`)."""
    models = [Model(gw.model_name, "model", 0, "loramux")]
    own: set[str] = set()
    for row in await gw.catalog.visible(principal.tenant_id):
        shadowed = row.owner == SHARED_OWNER and row.name in own
        model_id = f"{SHARED_OWNER}/{row.name}" if shadowed else row.name
        if row.owner != SHARED_OWNER:
            own.add(row.name)
        owned_by = "shared" if row.owner == SHARED_OWNER else principal.tenant_name
        models.append(
            Model(model_id, "model", int(row.created_at.timestamp()), owned_by, gw.model_name)
        )
    return ModelList("list", [m for m in models if principal.may_use(m.id)])


def openai_router(gw: GatewayState) -> Router:
    """/v1: the completion routes and the model list, behind the API-key guard."""

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        authorization = connection.headers.get("authorization")
        connection.state[PRINCIPAL] = await gw.keys.authenticate(authorization)

    def caller(request: Request[Any, Any, Any]) -> Principal:
        principal: Principal = request.state[PRINCIPAL]
        return principal

    return Router(
        "/v1",
        route_handlers=[chat_completions, completions, list_models],
        guards=[guard],
        dependencies={"principal": Provide(caller, sync_to_thread=False)},
        middleware=[record_unmetered(gw.usage, PRINCIPAL)],
    )
