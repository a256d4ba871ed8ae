"""OpenAI response shapes as msgspec structs: whole responses, stream chunks, logprobs, models.

They follow OpenAI's published OpenAPI document (tests validate real responses against the
vendored copy, tests/fixtures/openai_openapi): required fields are always written, optional ones
(`tool_calls`, a delta's `role`) only when set. A stream chunk's `usage` is left out, but with
`stream_options.include_usage`, where every chunk has it: `null` until the last chunk's usage.
`forbid_unknown_fields`, so a real response can be decoded into them to check they agree.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from loramux.gateway.openai.tools.schemas import ToolCall, ToolCallDelta

SSE_DONE = b"data: [DONE]\n\n"


class PromptTokensDetails(Struct, forbid_unknown_fields=True):
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""


class Usage(Struct, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        total = prompt_tokens + completion_tokens
        details = PromptTokensDetails(cached_tokens)
        return cls(prompt_tokens, completion_tokens, total, details)


class TopLogprob(Struct, forbid_unknown_fields=True):
    token: str
    logprob: float
    bytes: list[int] | None
    """The token's UTF-8 bytes (a byte-fallback token's one raw byte)."""


class TokenLogprobEntry(Struct, forbid_unknown_fields=True):
    """One generated token of a chat choice's `logprobs.content`."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct, forbid_unknown_fields=True):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class TextLogprobs(Struct, forbid_unknown_fields=True):
    """The legacy completions API's logprobs: parallel lists, one entry per token;
    `text_offset` is where the token's text starts in the choice's text: the length of the text of
    the tokens before it (the token that completes a stop string starts where they end, though
    the text is cut before the stop string)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Struct, forbid_unknown_fields=True):
    index: int
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None
    message: AssistantMessage


class ChatCompletion(Struct, forbid_unknown_fields=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    """Changes when what produces the output changes: the engine build, the base model or
    the adapter."""
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    """Only in the first chunk of a choice."""
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct, forbid_unknown_fields=True):
    index: int
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None
    delta: ChatDelta


class ChatCompletionChunk(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One `data:` event of a chat stream; the stream ends with `data: [DONE]`. With
    `stream_options.include_usage` the last chunk has no choices and the usage, and every
    other chunk `usage: null`, as OpenAI sends them."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType | None = UNSET
    """Left out, but with `stream_options.include_usage`: `null`, and on the last chunk the
    usage."""


class TextChoice(Struct, forbid_unknown_fields=True):
    index: int
    finish_reason: str | None
    logprobs: TextLogprobs | None
    text: str


class TextCompletion(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A whole text completion, or one `data:` event of a stream of them (it ends with
    `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: Usage | UnsetType | None = UNSET
    """A whole completion's usage; in a stream as a chat chunk's."""


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


Chunk = ChatCompletionChunk | TextCompletion

_encoder = msgspec.json.Encoder()


def sse(payload: object) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"
