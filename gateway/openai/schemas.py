"""OpenAI request bodies as msgspec structs, validated into engine requests.

Fields OpenAI has but loramux does not serve are declared so they can be refused with a clear
400 rather than silently ignored (n > 1, tools, logprobs, penalties, JSON mode, …).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta

from gateway.errors import BadRequest, UnsupportedMediaType

INT32_MAX = 2**31 - 1
MAX_NESTING = 32
"""Deepest nesting of arrays and objects a body may have (a chat body needs 5)."""

# Numeric fields are bounded here, so a 400 names the field: seeds are int64 (as OpenAI's
# schema has them), counts well inside what the engine, Redis and the engine wire can hold.
TokenCount = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=INT32_MAX)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class CacheOptions(msgspec.Struct, forbid_unknown_fields=True):
    """loramux extension: per-request response-cache control."""

    semantic: bool | None = None
    ttl: int | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None


class _Sampling(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None
    cache: CacheOptions | None = None
    # Declared to be refused when used:
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    functions: list[Any] | None = None
    function_call: Any | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    """A string, a list of token ids, or a one-element list of either."""
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def require_json(content_type: str | None) -> None:
    """415 unless the body is declared as UTF-8 JSON; a body with no Content-Type is read as
    JSON (what a bare `curl --data-binary` or an HTTP library's raw body sends)."""
    if content_type is None:
        return
    media, *params = (part.strip().lower() for part in content_type.split(";"))
    charsets = {p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")}
    if media != "application/json" or not charsets <= {"utf-8", "utf8"}:
        raise UnsupportedMediaType(
            f"the body must be JSON (Content-Type: application/json), not {content_type!r}"
        )


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Parse a JSON body into `kind`; malformed JSON and wrong types are 400s naming the field."""
    if not body:
        raise BadRequest("the request body is empty; send a JSON object")
    if nests_deeper_than(body, MAX_NESTING):
        raise BadRequest(f"the request body nests arrays and objects deeper than {MAX_NESTING}")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in message else None
        raise BadRequest(f"invalid request: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8: {exc}") from None


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
"""Openers to +1 and closers to -1 (as signed bytes)."""
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nests_deeper_than(body: bytes, limit: int) -> bool:
    """Whether arrays and objects in a JSON text nest deeper than `limit` (brackets inside
    strings do not count; unclosed openers count, as a parser descends into each before it
    finds the text malformed). The deepest level is the largest prefix sum of +1 per opener
    and -1 per closer, computed at C speed: a 1 MiB body of brackets takes milliseconds."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the common case, without reading strings
    steps = _JSON_STRING.sub(b"", body).translate(_STEPS, _NOT_BRACKETS)
    return int(np.cumsum(np.frombuffer(steps, dtype=np.int8), dtype=np.int64).max()) > limit


def refuse_unsupported(req: _Sampling) -> None:
    """400 for parameters loramux does not implement, instead of ignoring them."""
    if req.n not in (None, 1):
        raise BadRequest("only n=1 is supported", param="n")
    if req.logprobs:
        raise BadRequest("logprobs are not supported", param="logprobs")
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported", param="logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise BadRequest(f"{name} is not supported", param=name)
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise BadRequest("only response_format type 'text' is supported", param="response_format")
    if isinstance(req, ChatCompletionRequest):
        if req.tools or req.functions or req.tool_choice not in (None, "none") or req.function_call:
            raise BadRequest("tools and function calling are not supported", param="tools")
        if req.top_logprobs:
            raise BadRequest("logprobs are not supported", param="top_logprobs")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise BadRequest("echo is not supported", param="echo")
        if req.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise BadRequest("best_of is not supported", param="best_of")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: roles system/user/assistant, text content."""
    if not messages:
        raise BadRequest("messages must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant"):
            raise BadRequest(
                f"messages[{i}].role '{m.role}' is not supported", param=f"messages[{i}].role"
            )
        if m.tool_calls:
            raise BadRequest("tool calls are not supported", param=f"messages[{i}].tool_calls")
        out.append({"role": role, "content": _text(m.content, i)})
    return out


def _text(content: str | list[ContentPart] | None, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise BadRequest(
                f"content parts of type '{part.type}' are not supported",
                param=f"messages[{i}].content",
            )
        texts.append(part.text)
    return "".join(texts)
