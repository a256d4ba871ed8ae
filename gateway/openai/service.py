"""The rules of a completion request, in the order of the request path:

    resolve model → tokenize the prompt (once, off the event loop) → admission (quotas) → response cache →
    engine → finish (usage event, cache store, settle the reservation)

`prepare` does everything that can refuse the request, before a byte of the response is sent.
Once admitted, the request runs as a `Generation` of its own, and the reservation is settled
exactly once when it ends (success, error, or a client that left, which aborts it), by what the
engine generated: the prompt plus every completion token, or nothing when no token was
generated (refused by the engine, or left before its first token).

Cache hits count as one request against request and concurrency limits but consume no tokens:
their reservation is settled with 0, and their usage event records 0 billable tokens (the
response's `usage` still shows the original counts, as the client expects).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from cache.types import CachedResponse, CacheHit, CachePolicy, CacheRequest
from engine.outputs import EngineRequest
from engine.sampling import SamplingParams
from gateway.auth.api_keys import Principal
from gateway.cache_policy import cache_policy, cache_request
from gateway.catalog import ResolvedModel
from gateway.errors import BadRequest, ClientClosedRequest
from gateway.openai import shapes
from gateway.openai.generation import Generation
from gateway.openai.schemas import (
    INT32_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    refuse_unsupported,
)
from gateway.openai.shapes import Kind, ResponseMeta
from gateway.prefix_cache import cache_salt
from gateway.quotas import Admission
from gateway.state import GatewayState
from gateway.usage import UsageRecord

log = logging.getLogger(__name__)

HIT_CHUNK_CHARS = 16
"""A streamed cache hit is sent in pieces of this many characters."""


@dataclass
class Prepared:
    request: EngineRequest
    """What the engine gets: the prompt as token ids, sampling without stop strings."""
    stop: tuple[str, ...]
    """Stop strings, matched on the text as the gateway detokenizes."""
    meta: ResponseMeta
    model: ResolvedModel
    principal: Principal
    prompt_tokens: int
    stream: bool
    include_usage: bool
    admission: Admission | None
    cache_key: CacheRequest
    policy: CachePolicy
    hit: CacheHit | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def cache_outcome(self) -> str:
        if self.hit is not None:
            return self.hit.kind
        return "miss" if self.policy.lookup else "bypass"

    def headers(self) -> dict[str, str]:
        headers = dict(self.admission.headers) if self.admission is not None else {}
        headers["x-cache"] = self.cache_outcome
        if self.hit is not None and self.hit.similarity is not None:
            headers["x-cache-similarity"] = f"{self.hit.similarity:.4f}"
        return headers


class CompletionService:
    def __init__(self, gw: GatewayState):
        self.gw = gw

    async def prepare(
        self,
        principal: Principal,
        req: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        cache_control: str | None = None,
    ) -> Prepared:
        """Validate, resolve, admit and look up the cache; raises before anything is sent."""
        refuse_unsupported(req)
        model = await self.gw.catalog.resolve(principal, req.model)
        if model.digest is not None:
            await self.gw.engine.ensure_adapter(model.digest, self.gw.store.root / model.digest)
        requested = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None
        requested = requested if requested is not None else req.max_tokens
        salt = cache_salt(principal.tenant_id, principal.tenant_settings)
        text_request = self._engine_request(
            req, request_id, model, 1 if requested is None else requested, salt
        )
        prompt_ids = await self.gw.prompts.prompt_ids(text_request)
        prompt_tokens = len(prompt_ids)
        params = text_request.params
        if requested is None:
            room = self.gw.max_model_len - prompt_tokens
            cap = self.gw.settings.server.default_max_tokens
            params = replace(params, max_tokens=max(1, min(room, cap)))
            text_request = replace(text_request, params=params)
        # What crosses to the engine: token ids, and no stop strings (matched here, on text).
        engine_request = EngineRequest(
            request_id,
            replace(params, stop=()),
            prompt_token_ids=prompt_ids,
            adapter=model.digest,
            cache_salt=salt,
        )
        admission = await self.gw.quotas.admit(principal, prompt_tokens, params.max_tokens)
        try:
            deterministic = params.temperature == 0.0 or params.seed is not None
            body_cache = (
                {"semantic": req.cache.semantic, "ttl": req.cache.ttl} if req.cache else None
            )
            policy = cache_policy(
                principal.tenant_settings, cache_control, body_cache, deterministic
            )
            key = cache_request(
                principal.tenant_id, self.gw.model_name, text_request, req.response_format
            )
            hit = await self.gw.cache.lookup(key, policy, request_id) if policy.lookup else None
        except BaseException:
            await admission.settle(0)
            raise
        kind: Kind = "chat" if isinstance(req, ChatCompletionRequest) else "text"
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        meta = ResponseMeta(
            kind, f"{prefix}-{request_id.removeprefix('req_')}", int(time.time()), model.name
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Prepared(
            engine_request,
            params.stop,
            meta,
            model,
            principal,
            prompt_tokens,
            req.stream,
            include_usage,
            admission,
            key,
            policy,
            hit,
        )

    def _engine_request(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        model: ResolvedModel,
        max_tokens: int,
        salt: str,
    ) -> EngineRequest:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if len(stop) > 4:
            raise BadRequest("at most 4 stop sequences are allowed", param="stop")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=stop,
        )
        prompt: dict[str, Any]
        if isinstance(req, ChatCompletionRequest):
            prompt = {"messages": chat_messages(req.messages)}
        else:
            prompt = _completion_prompt(req.prompt)
        return EngineRequest(request_id, params, adapter=model.digest, cache_salt=salt, **prompt)

    # -- running ---------------------------------------------------------------------------------
    def _generate(self, p: Prepared) -> Generation:
        detokenizer = self.gw.prompts.detokenizer(p.stop)
        return Generation(
            self.gw.engine, p.request, detokenizer, p.started, partial(self._finish, p)
        )

    async def complete(
        self, p: Prepared, client_gone: Callable[[], Awaitable[None]]
    ) -> dict[str, Any]:
        """The whole response as one JSON object; generation is aborted if `client_gone()`
        returns first (the client closed its connection)."""
        if p.hit is not None:
            return await self._complete_hit(p, p.hit)
        run = self._generate(p)
        await run.wait(client_gone())
        if run.left:
            raise ClientClosedRequest("the client closed the connection")
        if run.error is not None:
            raise run.error
        usage = shapes.usage_json(p.prompt_tokens, run.completion_tokens, run.cached_tokens)
        return shapes.whole(p.meta, run.text, run.finish, usage)

    async def stream(self, p: Prepared) -> AsyncIterator[bytes]:
        """SSE chunks as OpenAI sends them, ending with `data: [DONE]`. The run ends (and is
        billed) before the end is sent, so the client's next request finds its cache entry and
        settled quota; a client that stops reading aborts it."""
        if p.hit is not None:
            async for piece in self._stream_hit(p, p.hit):
                yield piece
            return
        run = self._generate(p)
        try:
            if p.meta.kind == "chat":
                yield shapes.sse(shapes.chunk(p.meta, None, None, role=True))
            async for out in run.deltas():
                if out.text or out.finish_reason:
                    yield shapes.sse(shapes.chunk(p.meta, out.text, out.finish_reason))
            if run.error is not None:
                yield shapes.sse(run.error.body())
                return
            if p.include_usage:
                usage = shapes.usage_json(p.prompt_tokens, run.completion_tokens, run.cached_tokens)
                yield shapes.sse(shapes.usage_chunk(p.meta, usage))
            yield shapes.SSE_DONE
        finally:
            run.abort()

    async def _complete_hit(self, p: Prepared, hit: CacheHit) -> dict[str, Any]:
        r = hit.response
        await self._finish_hit(p, hit)
        return shapes.whole(
            p.meta,
            r.text,
            r.finish_reason,
            shapes.usage_json(r.prompt_tokens, r.completion_tokens, 0),
        )

    async def _stream_hit(self, p: Prepared, hit: CacheHit) -> AsyncIterator[bytes]:
        r = hit.response
        try:
            if p.meta.kind == "chat":
                yield shapes.sse(shapes.chunk(p.meta, None, None, role=True))
            for i in range(0, len(r.text), HIT_CHUNK_CHARS):
                yield shapes.sse(shapes.chunk(p.meta, r.text[i : i + HIT_CHUNK_CHARS], None))
            yield shapes.sse(shapes.chunk(p.meta, None, r.finish_reason))
            if p.include_usage:
                usage = shapes.usage_json(p.prompt_tokens, r.completion_tokens, 0)
                yield shapes.sse(shapes.usage_chunk(p.meta, usage))
            yield shapes.SSE_DONE
        finally:
            await self._finish_hit(p, hit)

    # -- finishing -------------------------------------------------------------------------------
    async def _finish(self, p: Prepared, run: Generation) -> None:
        """Meter, store in the cache, and settle the reservation (exactly once)."""
        completion = run.completion_tokens
        prompt = p.prompt_tokens if completion else 0
        try:
            self._meter(p, prompt, completion, run.cached_tokens, run.status, run.ttft)
            if run.status == 200 and run.finish is not None and p.policy.store:
                response = CachedResponse(run.text, run.finish, p.prompt_tokens, completion)
                await self.gw.cache.store(p.cache_key, p.policy, response, p.request.request_id)
        finally:
            if p.admission is not None:
                await p.admission.settle(prompt + completion)

    async def _finish_hit(self, p: Prepared, hit: CacheHit) -> None:
        try:
            self._meter(p, 0, 0, 0, 200, time.perf_counter() - p.started)
        finally:
            if p.admission is not None:
                await p.admission.settle(0)

    def _meter(
        self,
        p: Prepared,
        prompt: int,
        completion: int,
        cached: int,
        status: int,
        ttft: float | None,
    ) -> None:
        latency = time.perf_counter() - p.started
        kind = "adapter" if p.model.digest else "base"
        m = self.gw.metrics
        m.latency.labels(p.meta.kind).observe(latency)
        m.cache.labels(p.cache_outcome).inc()
        if ttft is not None:
            m.ttft.labels(kind).observe(ttft)
        m.tokens.labels(kind, "prompt").inc(prompt)
        m.tokens.labels(kind, "completion").inc(completion)
        self.gw.usage.record(
            UsageRecord(
                request_id=p.request.request_id,
                tenant_id=p.principal.tenant_id,
                key_id=p.principal.key_id,
                model=p.model.name,
                adapter_digest=p.model.digest,
                prompt_tokens=prompt,
                completion_tokens=completion,
                cached_tokens=cached,
                cache=p.cache_outcome,
                status=status,
                latency_ms=latency * 1000,
                ttft_ms=ttft * 1000 if ttft is not None else None,
                admitted_at=p.admission.admitted_at if p.admission is not None else None,
            )
        )


def _completion_prompt(prompt: str | list[Any], nested: bool = False) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t <= INT32_MAX for t in prompt):
            raise BadRequest("prompt token ids must be between 0 and 2^31 - 1", param="prompt")
        return {"prompt_token_ids": list(prompt)}
    if len(prompt) == 1 and not nested and isinstance(prompt[0], str | list):
        return _completion_prompt(prompt[0], nested=True)
    raise BadRequest(
        "prompt must be a string, a list of token ids, or a list holding one of those",
        param="prompt",
    )
