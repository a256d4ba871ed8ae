"""A completion request's place in the response cache: its identity (the key) and what the
cache may do with it (the policy), from the tenant's settings, the request's `Cache-Control`
header and its `cache` body extension (gateway.cache_policy has the rules)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec

from loramux.cache.types import CachePolicy, CacheRequest
from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.cache_policy import cache_policy, cache_request, is_deterministic
from loramux.gateway.openai.prepared import Draft, ServingLimits
from loramux.gateway.openai.schemas import ChatCompletionRequest, CompletionRequest


def cache_plan(
    limits: ServingLimits,
    principal: Principal,
    req: ChatCompletionRequest | CompletionRequest,
    draft: Draft,
    cache_control: str | None,
) -> tuple[CacheRequest, CachePolicy]:
    """The request's identity in the response cache, and what the cache may do with it, known
    before its prompt is tokenized (so a lookup can start meanwhile). A request without a
    max_tokens keys on the rule that derives it from the prompt (the server's default, at most
    the room the context leaves): the same prompt under the same limits gets the same one. A
    request for more than one choice is neither looked up nor stored: an entry is one choice."""
    text_request = draft.text_request
    params = text_request.params
    max_tokens: int | str = params.max_tokens
    if not draft.max_tokens_given:
        max_tokens = f"default {limits.default_max_tokens}, room in {limits.max_model_len}"
    body_cache = {"semantic": req.cache.semantic, "ttl": req.cache.ttl} if req.cache else None
    policy = cache_policy(
        principal.tenant_settings, cache_control, body_cache, is_deterministic(params)
    )
    if params.n > 1:
        policy = replace(policy, lookup=False, store=False)
    key = cache_request(
        principal.tenant_id,
        limits.base_model,
        text_request,
        msgspec.to_builtins(req.response_format),
        _tools(req),
        max_tokens,
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
