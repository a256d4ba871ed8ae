"""OpenAI request bodies as msgspec structs, validated into engine requests.

Fields OpenAI has but loramux does not serve are declared so they can be refused with a clear
400 rather than silently ignored (n > 1, tools, logprobs, penalties, JSON mode, …).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.errors import BadRequest


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
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
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
    max_completion_tokens: int | None = None
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


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Parse a JSON body into `kind`; malformed JSON and wrong types are 400s naming the field."""
    if not body:
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in message else None
        raise BadRequest(f"invalid request: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


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
