"""Thin handlers for the OpenAI-compatible routes; the rules live in `service`."""

from __future__ import annotations

from functools import partial
from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.response import Stream

from gateway.auth.api_keys import Principal
from gateway.db.adapter import SHARED_OWNER
from gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    decode,
    require_json,
)
from gateway.openai.service import CompletionService
from gateway.state import GatewayState

GW = NamedDependency[GatewayState]
Caller = NamedDependency[Principal]


async def _respond(
    gw: GatewayState,
    request: Request[Any, Any, Any],
    kind: type[ChatCompletionRequest | CompletionRequest],
    principal: Principal,
) -> Response[Any]:
    service = CompletionService(gw)
    require_json(request.headers.get("content-type"))
    body = decode(await request.body(), kind)
    request_id = request.scope["state"]["request_id"]
    prepared = await service.prepare(
        principal, body, request_id, request.headers.get("cache-control")
    )
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


@post("/v1/chat/completions", status_code=200)
async def chat_completions(
    request: Request[Any, Any, Any], gw: GW, principal: Caller
) -> Response[Any]:
    """OpenAI chat completions; `model` is an adapter name, `owner/name`, or the base model id."""
    return await _respond(gw, request, ChatCompletionRequest, principal)


@post("/v1/completions", status_code=200)
async def completions(request: Request[Any, Any, Any], gw: GW, principal: Caller) -> Response[Any]:
    """OpenAI text completions for a raw prompt."""
    return await _respond(gw, request, CompletionRequest, principal)


@get("/v1/models")
async def list_models(gw: GW, principal: Caller) -> dict[str, Any]:
    """The base model and every adapter this key may use (own adapters first; a shared adapter
    shadowed by an own one of the same name is listed as `shared/<name>`)."""
    models = [{"id": gw.model_name, "object": "model", "created": 0, "owned_by": "loramux"}]
    own: set[str] = set()
    for row in await gw.catalog.visible(principal.tenant_id):
        shadowed = row.owner == SHARED_OWNER and row.name in own
        model_id = f"{SHARED_OWNER}/{row.name}" if shadowed else row.name
        if row.owner != SHARED_OWNER:
            own.add(row.name)
        models.append(
            {
                "id": model_id,
                "object": "model",
                "created": int(row.created_at.timestamp()),
                "owned_by": "shared" if row.owner == SHARED_OWNER else principal.tenant_name,
                "parent": gw.model_name,
            }
        )
    return {"object": "list", "data": [m for m in models if principal.may_use(str(m["id"]))]}
