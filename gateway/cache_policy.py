"""What a completion request may do with the response cache, from the tenant's settings, the
request's `Cache-Control` header and its `cache` body extension.

Rules:
- Only deterministic requests (temperature 0, or a seed given) are cached, unless the tenant
  sets `cache_sampled`; the cache can be turned off per tenant (`enabled`).
- `Cache-Control: no-cache` skips the lookup but stores the fresh answer; `no-store` does
  neither. Both are honoured whatever the tenant's settings.
- Semantic hits need the tenant to enable them (an admin: `PUT /admin/tenants/{id}/cache`) and
  the request not to refuse them (`"cache": {"semantic": false}`); never for sampled requests.
- The entry's lifetime is the body's `cache.ttl` when given (1 s to 7 days), else the tenant's.

The tenant's settings live in `Tenant.settings["cache"]`; absent fields take `DEFAULTS`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from loramux.cache.pacing import HitPacing, Pacing
from loramux.cache.types import CachePolicy, CacheRequest, VerifierName
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.gateway.errors import BadRequest

MAX_TTL = 7 * 86400
"""Longest entry lifetime a tenant or a request may ask for (seconds)."""


@dataclass(frozen=True)
class TenantCacheSettings:
    """A tenant's response-cache settings (`Tenant.settings["cache"]`)."""

    enabled: bool = True
    """Cache this tenant's responses at all."""
    semantic: bool = False
    """Serve semantic hits (similar questions in the same conversation context)."""
    threshold: float = 0.90
    """Cosine similarity a semantic candidate needs before the verifier looks at it (the highest
    that keeps recall on the tuning folds of bench/data/paraphrase_pairs.jsonl at 0.6)."""
    verifier: VerifierName = "strict"
    """`strict`: numbers, entities, negations, units, antonyms and relations must agree and
    every content word must meet the same word or a synonym (`cache.verifier`); `off`."""
    hit_pacing: HitPacing = "instant"
    """How a streamed cache hit is sent: `instant` (as fast as the connection takes it) or
    `paced`: one piece per completion token, `hit_tokens_per_second` apart (`cache.pacing`)."""
    hit_tokens_per_second: float = 30.0
    ttl: int = 3600
    """Default entry lifetime, seconds."""
    cache_sampled: bool = False
    """Also cache sampled requests (temperature > 0 and no seed): exact hits only."""

    @classmethod
    def of(cls, tenant_settings: dict[str, Any]) -> TenantCacheSettings:
        """The settings stored on a tenant, defaults for what is absent."""
        stored = tenant_settings.get("cache")
        if not isinstance(stored, dict):
            return cls()
        known = {k: v for k, v in stored.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULTS = TenantCacheSettings().as_dict()


def is_deterministic(params: SamplingParams) -> bool:
    return params.greedy or params.seed is not None


def cache_policy(
    tenant_settings: dict[str, Any],
    cache_control: str | None,
    body_cache: dict[str, Any] | None,
    deterministic: bool,
) -> CachePolicy:
    """The policy of one request (see the module docstring). `tenant_settings` is the whole
    `Tenant.settings` (as `Principal.tenant_settings` carries it). BadRequest for a bad ttl."""
    settings = TenantCacheSettings.of(tenant_settings)
    body = body_cache or {}
    directives = {d.strip().lower() for d in (cache_control or "").split(",")}
    cacheable = settings.enabled and (deterministic or settings.cache_sampled)
    ttl = body.get("ttl")
    if ttl is None:
        ttl = settings.ttl
    elif isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= MAX_TTL:
        raise BadRequest(f"cache.ttl must be an integer from 1 to {MAX_TTL}", param="cache.ttl")
    return CachePolicy(
        lookup=cacheable and "no-cache" not in directives and "no-store" not in directives,
        store=cacheable and "no-store" not in directives,
        semantic=settings.semantic and deterministic and body.get("semantic") is not False,
        ttl=ttl,
        threshold=settings.threshold,
        verifier=settings.verifier,
        pacing=Pacing(settings.hit_pacing, settings.hit_tokens_per_second),
    )


def cache_request(
    tenant_id: str,
    base_model: str,
    request: EngineRequest,
    response_format: dict[str, Any] | None = None,
    tools: dict[str, Any] | None = None,
) -> CacheRequest:
    """The cache's identity of an engine request, after the model is resolved. `base_model`
    is the served base model's name and identity (`ServingLimits.served_base`: new weights under
    the same name never meet the old weights' entries); `tools` holds the request's tools,
    tool_choice and parallel_tool_calls (as JSON values).

    Greedy requests leave out top_p, top_k, min_p and seed: greedy decoding ignores them, so
    requests that differ only there get the same answer and share an entry.
    """
    p = request.params
    params: dict[str, Any] = {
        "max_tokens": p.max_tokens,
        "temperature": float(p.temperature),
        "stop": p.stop,
        "stop_token_ids": p.stop_token_ids,
        "ignore_eos": p.ignore_eos,
        "response_format": _canonical(response_format),
        "n": p.n,
        "presence_penalty": float(p.presence_penalty),
        "frequency_penalty": float(p.frequency_penalty),
        "repetition_penalty": float(p.repetition_penalty),
        "logit_bias": p.logit_bias,
        "logprobs": p.logprobs,
        "top_logprobs": p.top_logprobs,
        "tools": _canonical(tools),
    }
    if not p.greedy:
        params |= {"top_p": float(p.top_p), "top_k": p.top_k, "min_p": p.min_p, "seed": p.seed}
    messages = None
    if request.messages is not None:
        messages = tuple((str(m["role"]), str(m["content"])) for m in request.messages)
        params |= _beyond_pairs(request.messages)
    prompt: str | tuple[int, ...] | None = request.prompt
    if request.prompt_token_ids is not None:
        prompt = tuple(request.prompt_token_ids)
    return CacheRequest(
        tenant_id=tenant_id,
        base_model=base_model,
        adapter=request.adapter or "base",
        kind="chat" if messages is not None else "text",
        messages=messages,
        prompt=prompt,
        params=tuple(sorted(params.items())),
    )


def _beyond_pairs(messages: list[dict[str, Any]]) -> dict[str, str | None]:
    """What the messages give the template beyond (role, content) pairs: tool turns, names."""
    return {"tool_turns": _tool_turns(messages), "names": _names(messages)}


def _tool_turns(messages: list[dict[str, Any]]) -> str | None:
    """The calls and call ids of a history's tool turns, which (role, content) pairs miss, as the
    template takes them. A call's arguments keep the client's key order: the template writes
    them with `tojson`, which does not sort, so two orders are two prompts."""
    turns = [
        [i, m.get("tool_calls"), m.get("tool_call_id")]
        for i, m in enumerate(messages)
        if "tool_calls" in m or "tool_call_id" in m
    ]
    return json.dumps(turns, separators=(",", ":")) if turns else None


def _names(messages: list[dict[str, Any]]) -> str | None:
    """Each named message's index and `name`, which (role, content) pairs miss: a template that
    writes names makes them part of the prompt."""
    names = [[i, m["name"]] for i, m in enumerate(messages) if "name" in m]
    return json.dumps(names, separators=(",", ":"), ensure_ascii=False) if names else None


def _canonical(value: dict[str, Any] | None) -> str | None:
    """`response_format` (or the tools) as compact JSON, keys in the order the client wrote
    them: a schema's property order is the order the output's keys are generated in (and the
    order the chat template renders tools in), so schemas differing only there are different
    requests. `{"type": "text"}` is the default response format, so it is None."""
    if not value or value == {"type": "text"}:
        return None
    return json.dumps(value, separators=(",", ":"))
