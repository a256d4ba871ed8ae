"""A completion request's place in the response cache: its identity (the key) and what the
cache may do with it (the policy), from the tenant's settings, the request's `Cache-Control`
header and its `cache` body extension (gateway.cache_policy has the rules)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec

from loramux.cache.types import CachePolicy, CacheRequest
from loramux.engine.outputs import EngineRequest
from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.cache_policy import cache_policy, cache_request, is_deterministic
from loramux.gateway.openai.schemas import ChatCompletionRequest, CompletionRequest


def cache_plan(
    base_model: str,
    principal: Principal,
    req: ChatCompletionRequest | CompletionRequest,
    text_request: EngineRequest,
    cache_control: str | None,
) -> tuple[CacheRequest, CachePolicy]:
    """The request's identity in the response cache, and what the cache may do with it
    (`base_model`: the base model's name and identity, `ServingLimits.served_base`). A
    request for more than one choice is neither looked up nor stored: an entry is one choice."""
    params = text_request.params
    body_cache = {"semantic": req.cache.semantic, "ttl": req.cache.ttl} if req.cache else None
    policy = cache_policy(
        principal.tenant_settings, cache_control, body_cache, is_deterministic(params)
    )
    if params.n > 1:
        policy = replace(policy, lookup=False, store=False)
    key = cache_request(
        principal.tenant_id,
        base_model,
        text_request,
        msgspec.to_builtins(req.response_format),
        _tools(req),
    )
    return key, policy


def _tools(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """What of the request's tool use changes the output, as JSON values."""
    if not isinstance(req, ChatCompletionRequest) or req.tools is None:
        return None
    return {
        "tools": msgspec.to_builtins(req.tools),
        "tool_choice": msgspec.to_builtins(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
    }
