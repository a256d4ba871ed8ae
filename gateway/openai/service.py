"""The rules of a completion request: resolve the model, build the engine request, run it, and
shape the result as OpenAI does (a whole response or SSE chunks), metering as it goes."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import EngineError
from engine.outputs import EngineRequest, Usage
from engine.sampling import SamplingParams
from gateway.auth.api_keys import Principal
from gateway.catalog import ResolvedModel
from gateway.errors import BadRequest, GatewayError, to_gateway_error
from gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    refuse_unsupported,
)
from gateway.state import GatewayState
from gateway.usage import UsageRecord

log = logging.getLogger(__name__)

Kind = Literal["chat", "text"]


@dataclass
class Prepared:
    kind: Kind
    request: EngineRequest
    model: ResolvedModel
    principal: Principal
    prompt_tokens: int
    stream: bool
    include_usage: bool
    started: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return f"{prefix}-{self.request.request_id.removeprefix('req_')}"


class CompletionService:
    def __init__(self, gw: GatewayState):
        self.gw = gw

    async def prepare(
        self, principal: Principal, req: ChatCompletionRequest | CompletionRequest, request_id: str
    ) -> Prepared:
        """Validate and resolve everything before a byte of the response is sent."""
        refuse_unsupported(req)
        model = await self.gw.catalog.resolve(principal, req.model)
        if model.digest is not None and model.owner is not None:
            await self.gw.engine.ensure_adapter(model.digest, self.gw.store.root / model.digest)
        kind: Kind = "chat" if isinstance(req, ChatCompletionRequest) else "text"
        max_tokens = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None
        max_tokens = max_tokens if max_tokens is not None else req.max_tokens
        engine_request = self._engine_request(
            req, request_id, model, 1 if max_tokens is None else max_tokens
        )
        prompt_tokens = await self.gw.engine.count_tokens(engine_request)
        if max_tokens is None:
            room = self.gw.max_model_len - prompt_tokens
            cap = self.gw.settings.server.default_max_tokens
            engine_request = self._engine_request(req, request_id, model, max(1, min(room, cap)))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Prepared(
            kind, engine_request, model, principal, prompt_tokens, req.stream, include_usage
        )

    def _engine_request(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        request_id: str,
        model: ResolvedModel,
        max_tokens: int,
    ) -> EngineRequest:
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if len(stop) > 4:
            raise BadRequest("at most 4 stop sequences are allowed", param="stop")
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0.0 <= temperature <= 2.0:
            raise BadRequest("temperature must be between 0 and 2", param="temperature")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
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
        return EngineRequest(request_id, params, adapter=model.digest, **prompt)

    # -- running ---------------------------------------------------------------------------------
    async def complete(self, p: Prepared) -> dict[str, Any]:
        """The whole response as one JSON object."""
        texts: list[str] = []
        usage: Usage | None = None
        finish: str | None = None
        ttft: float | None = None
        async for out in self.gw.engine.generate(p.request):
            ttft = ttft if ttft is not None else time.perf_counter() - p.started
            texts.append(out.text)
            usage, finish = out.usage or usage, out.finish_reason or finish
        self._meter(p, usage, 200, ttft)
        text = "".join(texts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if p.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        return {
            "id": p.response_id,
            "object": "chat.completion" if p.kind == "chat" else "text_completion",
            "created": p.created,
            "model": p.model.name,
            "system_fingerprint": None,
            "choices": [choice],
            "usage": _usage_json(usage, p.prompt_tokens),
        }

    async def stream(self, p: Prepared) -> AsyncIterator[bytes]:
        """SSE chunks as OpenAI sends them, ending with `data: [DONE]`."""
        usage: Usage | None = None
        ttft: float | None = None
        status = 200
        try:
            if p.kind == "chat":
                yield _sse(self._chunk(p, {"role": "assistant", "content": ""}, None))
            async for out in self.gw.engine.generate(p.request):
                ttft = ttft if ttft is not None else time.perf_counter() - p.started
                usage = out.usage or usage
                if out.text or out.finish_reason:
                    delta = {"content": out.text} if out.text or p.kind == "text" else {}
                    yield _sse(self._chunk(p, delta, out.finish_reason))
            if p.include_usage:
                yield _sse(
                    {
                        **self._chunk(p, {}, None),
                        "choices": [],
                        "usage": _usage_json(usage, p.prompt_tokens),
                    }
                )
            yield b"data: [DONE]\n\n"
        except (EngineError, GatewayError) as exc:
            err = to_gateway_error(exc) or GatewayError(str(exc))
            status = err.status
            yield _sse(err.body())
        finally:
            self._meter(p, usage, status if usage is not None else 499, ttft)

    def _chunk(self, p: Prepared, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if p.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta.get("content", "")
        return {
            "id": p.response_id,
            "object": "chat.completion.chunk" if p.kind == "chat" else "text_completion",
            "created": p.created,
            "model": p.model.name,
            "system_fingerprint": None,
            "choices": [choice],
        }

    def _meter(self, p: Prepared, usage: Usage | None, status: int, ttft: float | None) -> None:
        latency = time.perf_counter() - p.started
        kind = "adapter" if p.model.digest else "base"
        m = self.gw.metrics
        m.latency.labels(p.kind).observe(latency)
        if ttft is not None:
            m.ttft.labels(kind).observe(ttft)
        completion = usage.completion_tokens if usage else 0
        m.tokens.labels(kind, "prompt").inc(p.prompt_tokens)
        m.tokens.labels(kind, "completion").inc(completion)
        self.gw.usage.record(
            UsageRecord(
                request_id=p.request.request_id,
                tenant_id=p.principal.tenant_id,
                key_id=p.principal.key_id,
                model=p.model.name,
                adapter_digest=p.model.digest,
                prompt_tokens=p.prompt_tokens,
                completion_tokens=completion,
                cached_tokens=usage.cached_tokens if usage else 0,
                cache="miss",
                status=status,
                latency_ms=latency * 1000,
                ttft_ms=ttft * 1000 if ttft is not None else None,
            )
        )


def _completion_prompt(prompt: str | list[Any], nested: bool = False) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": list(prompt)}
    if len(prompt) == 1 and not nested and isinstance(prompt[0], str | list):
        return _completion_prompt(prompt[0], nested=True)
    raise BadRequest(
        "prompt must be a string, a list of token ids, or a list holding one of those",
        param="prompt",
    )


def _usage_json(usage: Usage | None, prompt_tokens: int) -> dict[str, Any]:
    completion = usage.completion_tokens if usage else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens if usage else 0},
    }


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
