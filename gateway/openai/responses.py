"""What a completion answers, in OpenAI's shapes: the parts a response streams (`Part`), how it
ends (`Ending`, with each choice's whole `Answer`), and the objects written for them.

A run's deltas and a cache hit's replay both come out as parts and an ending, so a streamed
response and a whole one are made from the same sequence (`CompletionService.outputs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from loramux.cache.pacing import Pacing, hit_pieces
from loramux.cache.types import CachedResponse, CacheHit
from loramux.gateway.errors import GatewayError
from loramux.gateway.openai.generation import ChoiceDelta, ChoiceRun
from loramux.gateway.openai.logprobs import TokenPieces
from loramux.gateway.openai.shapes import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    Chunk,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    Usage,
)
from loramux.gateway.openai.tools import ParsedToolCalls, ToolCallStreamParser
from loramux.gateway.openai.tools.schemas import FunctionCallDelta, ToolCall, ToolCallDelta

Kind = Literal["chat", "text"]
Logprobs = ChoiceLogprobs | TextLogprobs


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response shares."""

    kind: Kind
    id: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool = False
    """`stream_options.include_usage`: every stream chunk has `usage`, `null` but on the last."""

    @property
    def chunk_usage(self) -> UnsetType | None:
        """A stream chunk's `usage` before the last: `null` with `include_usage`, else left out."""
        return None if self.include_usage else UNSET

    def answered_by(self, hit: CacheHit | None) -> ResponseMeta:
        """What a response answered by `hit` (None: by the engine) shares: a hit names the
        `system_fingerprint` its answer was made under, which another engine build's differs
        from this one's."""
        if hit is None or not hit.response.fingerprint:
            return self
        return replace(self, fingerprint=hit.response.fingerprint)


@dataclass(frozen=True)
class Part:
    """A piece of one choice, as a stream chunk carries it."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: Logprobs | None = None
    tool_calls: list[ToolCallDelta] | None = None


@dataclass(frozen=True)
class Answer:
    """One whole choice: what a whole response has, and what the cache keeps."""

    text: str
    finish_reason: str | None
    logprobs: Logprobs | None = None
    tool_calls: list[ToolCall] | None = None


@dataclass(frozen=True)
class Ending:
    """How a response ends: its choices whole and its usage, or the error that ended it."""

    answers: list[Answer]
    usage: Usage
    error: GatewayError | None = None


def part_of(
    delta: ChoiceDelta, kind: Kind, pieces: TokenPieces, reader: ToolCallStreamParser | None
) -> Part:
    """The part a delta makes; with a tool-call `reader`, its text read into content and
    tool-call deltas (and finish reason `tool_calls` when the choice made calls)."""
    logprobs = _logprobs(delta, kind, pieces)
    if reader is None:
        return Part(delta.index, delta.text, delta.finish_reason, logprobs)
    sent = reader.feed(delta.text)
    finish = delta.finish_reason
    if finish is not None:
        sent += reader.finish()
        finish = "tool_calls" if reader.calls else finish
    content = "".join(s for s in sent if isinstance(s, str))
    calls = [s for s in sent if not isinstance(s, str)]
    return Part(delta.index, content, finish, logprobs, calls or None)


def answer_of(
    choice: ChoiceRun,
    kind: Kind,
    pieces: TokenPieces,
    logprobs: bool,
    parsed: ParsedToolCalls | None,
) -> Answer:
    """A choice whole: with `parsed` (its text read for tool calls), their content and calls."""
    lp = _logprobs(choice, kind, pieces) if logprobs else None
    if parsed is None:
        return Answer(choice.text, choice.finish, lp)
    finish = "tool_calls" if parsed.calls and choice.finish is not None else choice.finish
    return Answer(parsed.content or "", finish, lp, parsed.calls or None)


def _logprobs(got: ChoiceDelta | ChoiceRun, kind: Kind, pieces: TokenPieces) -> Logprobs | None:
    if got.logprobs is None or (not got.logprobs and not got.token_ids):
        return None if isinstance(got, ChoiceDelta) else _empty(kind)
    ids = got.token_ids[: len(got.logprobs)]
    if kind == "chat":
        entries = pieces.chat_entries(ids, got.logprobs)
        if not entries and isinstance(got, ChoiceDelta):
            return None  # a delta of tokens the content does not show (the end of turn)
        return ChoiceLogprobs(entries)
    return pieces.text_logprobs(ids, got.logprobs, got.offsets[: len(ids)])


def _empty(kind: Kind) -> Logprobs:
    return ChoiceLogprobs([]) if kind == "chat" else TextLogprobs([], [], [], [])


# -- the cache -------------------------------------------------------------------------------------
def cached(
    answer: Answer, prompt_tokens: int, completion_tokens: int, fingerprint: str
) -> CachedResponse:
    """The entry of an answer made under `fingerprint` (this build's `system_fingerprint`)."""
    return CachedResponse(
        answer.text,
        answer.finish_reason or "stop",
        prompt_tokens,
        completion_tokens,
        logprobs=msgspec.to_builtins(answer.logprobs),
        tool_calls=msgspec.to_builtins(answer.tool_calls),
        fingerprint=fingerprint,
    )


def replayed(response: CachedResponse, kind: Kind) -> Answer:
    """The answer a cache entry holds, exactly as it was given."""
    logprobs_type = ChoiceLogprobs if kind == "chat" else TextLogprobs
    return Answer(
        response.text,
        response.finish_reason,
        msgspec.convert(response.logprobs, logprobs_type | None),
        msgspec.convert(response.tool_calls, list[ToolCall] | None),
    )


def replay_parts(
    answer: Answer, completion_tokens: int, pacing: Pacing
) -> Iterator[tuple[Part, float]]:
    """A cached answer as stream parts, each with the delay before it is sent (the tenant's
    `cache.pacing`: at once, or a piece per completion token at its rate): the logprobs and
    tool calls with the first part, the finish reason last."""
    calls = [
        ToolCallDelta(i, _function_delta(call), call.id, "function")
        for i, call in enumerate(answer.tool_calls or [])
    ]
    for n, (piece, delay) in enumerate(hit_pieces(answer.text, completion_tokens, pacing)):
        if n == 0:
            yield Part(0, piece, None, answer.logprobs, calls or None), delay
        else:
            yield Part(0, piece, None), delay
    yield Part(0, "", answer.finish_reason), 0.0


def _function_delta(call: ToolCall) -> FunctionCallDelta:
    return FunctionCallDelta(call.function.name, call.function.arguments)


# -- the objects written -----------------------------------------------------------------------------
def chunk(meta: ResponseMeta, part: Part) -> Chunk:
    if meta.kind == "text":
        logprobs = part.logprobs if isinstance(part.logprobs, TextLogprobs) else None
        choice = TextChoice(part.index, part.finish_reason, logprobs, part.text)
        return TextCompletion(
            meta.id,
            "text_completion",
            meta.created,
            meta.model,
            meta.fingerprint,
            [choice],
            meta.chunk_usage,
        )
    chat_logprobs = part.logprobs if isinstance(part.logprobs, ChoiceLogprobs) else None
    delta = ChatDelta(content=part.text or None, tool_calls=part.tool_calls)
    return _chat_chunk(
        meta, [ChatChunkChoice(part.index, part.finish_reason, chat_logprobs, delta)]
    )


def openings(meta: ResponseMeta, n: int) -> list[ChatCompletionChunk]:
    """A chat stream's first chunk of each choice: the role, empty content."""
    delta = ChatDelta(role="assistant", content="")
    return [_chat_chunk(meta, [ChatChunkChoice(i, None, None, delta)]) for i in range(n)]


def usage_chunk(meta: ResponseMeta, usage: Usage) -> Chunk:
    """The final chunk of `stream_options.include_usage`: no choices, the usage."""
    if meta.kind == "text":
        return TextCompletion(
            meta.id, "text_completion", meta.created, meta.model, meta.fingerprint, [], usage
        )
    return _chat_chunk(meta, [], usage)


def _chat_chunk(
    meta: ResponseMeta, choices: list[ChatChunkChoice], usage: Usage | None = None
) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        meta.id,
        "chat.completion.chunk",
        meta.created,
        meta.model,
        meta.fingerprint,
        choices,
        meta.chunk_usage if usage is None else usage,
    )


def whole(meta: ResponseMeta, ending: Ending) -> ChatCompletion | TextCompletion:
    if meta.kind == "text":
        choices = [
            TextChoice(
                i,
                a.finish_reason,
                a.logprobs if isinstance(a.logprobs, TextLogprobs) else None,
                a.text,
            )
            for i, a in enumerate(ending.answers)
        ]
        return TextCompletion(
            meta.id,
            "text_completion",
            meta.created,
            meta.model,
            meta.fingerprint,
            choices,
            ending.usage,
        )
    return ChatCompletion(
        meta.id,
        "chat.completion",
        meta.created,
        meta.model,
        meta.fingerprint,
        [_chat_choice(i, a) for i, a in enumerate(ending.answers)],
        ending.usage,
    )


def _chat_choice(index: int, answer: Answer) -> ChatChoice:
    content = None if answer.tool_calls and not answer.text else answer.text
    message = AssistantMessage("assistant", content, None, answer.tool_calls)
    logprobs = answer.logprobs if isinstance(answer.logprobs, ChoiceLogprobs) else None
    return ChatChoice(index, answer.finish_reason, logprobs, message)
