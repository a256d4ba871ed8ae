"""OpenAI response shapes: whole responses, stream chunks, usage, SSE framing.

The builders write dicts; the structs below name the same shapes for the OpenAPI document
(`forbid_unknown_fields`, so a real response can be decoded into them to check they agree)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from msgspec import Struct

Kind = Literal["chat", "text"]


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response shares."""

    kind: Kind
    id: str
    created: int
    model: str


class PromptTokensDetails(Struct, forbid_unknown_fields=True):
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""


class Usage(Struct, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(Struct, forbid_unknown_fields=True):
    role: Literal["assistant"]
    content: str
    refusal: None


class ChatChoice(Struct, forbid_unknown_fields=True):
    index: int
    finish_reason: str | None
    logprobs: None
    message: AssistantMessage


class ChatCompletion(Struct, forbid_unknown_fields=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Struct, forbid_unknown_fields=True):
    role: Literal["assistant"] | None = None
    """Only in the first chunk."""
    content: str | None = None


class ChatChunkChoice(Struct, forbid_unknown_fields=True):
    index: int
    finish_reason: str | None
    logprobs: None
    delta: ChatDelta


class ChatCompletionChunk(Struct, forbid_unknown_fields=True):
    """One `data:` event of a chat stream; the stream ends with `data: [DONE]`. With
    `stream_options.include_usage` the last chunk has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TextChoice(Struct, forbid_unknown_fields=True):
    index: int
    finish_reason: str | None
    logprobs: None
    text: str


class TextCompletion(Struct, forbid_unknown_fields=True):
    """A whole text completion, or one `data:` event of a stream of them (a stream's chunks
    have no usage, but for the last one with `stream_options.include_usage`; it ends with
    `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[TextChoice]
    usage: Usage | None = None


class Model(Struct, omit_defaults=True, forbid_unknown_fields=True):
    id: str
    """What a request's `model` names: the base model, an adapter, or `shared/<name>`."""
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None = None
    """The base model of an adapter."""


class ModelList(Struct, forbid_unknown_fields=True):
    object: Literal["list"]
    data: list[Model]


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
