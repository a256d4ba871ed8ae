"""OpenAI response shapes: whole responses, stream chunks, usage, SSE framing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["chat", "text"]


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response shares."""

    kind: Kind
    id: str
    created: int
    model: str


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def whole(
    meta: ResponseMeta, text: str, finish: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if meta.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
    else:
        choice["text"] = text
    return {
        "id": meta.id,
        "object": "chat.completion" if meta.kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": None,
        "choices": [choice],
        "usage": usage,
    }


def chunk(
    meta: ResponseMeta, text: str | None, finish: str | None, role: bool = False
) -> dict[str, Any]:
    """One stream chunk; `role` marks a chat stream's opening chunk."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if meta.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {
        "id": meta.id,
        "object": "chat.completion.chunk" if meta.kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": None,
        "choices": [choice],
    }


def usage_chunk(meta: ResponseMeta, usage: dict[str, Any]) -> dict[str, Any]:
    """The final chunk of `stream_options.include_usage`: no choices, the usage."""
    return {**chunk(meta, None, None), "choices": [], "usage": usage}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
