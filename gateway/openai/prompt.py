"""The prompt of a request as the engine takes it: chat messages for the model's template (tool
calls and tool results included), or a raw prompt as text or token ids."""

from __future__ import annotations

from typing import Any

from loramux.gateway.errors import BadRequest
from loramux.gateway.openai.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
)
from loramux.gateway.openai.tools import ToolCallFormat, template_tool_calls, template_tool_result

ROLES = ("system", "user", "assistant", "tool")


def engine_prompt(
    req: ChatCompletionRequest | CompletionRequest,
    vocab_size: int,
    template_tools: list[dict[str, Any]] | None = None,
    fmt: ToolCallFormat | None = None,
    named_roles: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The EngineRequest fields that carry the prompt: `messages` (with the `tools` the
    template renders), `prompt` or `prompt_token_ids` (each below `vocab_size`). `fmt` is the
    model's tool-call format; `named_roles` the roles whose `name` its chat template writes
    (`PromptTokens.named_roles`)."""
    if isinstance(req, ChatCompletionRequest):
        messages = chat_messages(req.messages, fmt, named_roles)
        return {"messages": messages, "tools": template_tools}
    return _completion_prompt(req.prompt, vocab_size)


MAX_MESSAGES = 2048
"""Messages in one request at most. The prompt's length check before tokenizing counts the
messages' text, not the chat template's markup around each: without a bound, 55,000 empty
messages (1 MB) made 275,000 tokens of markup that were rendered and tokenized before the
context refused them."""


def chat_messages(
    messages: list[ChatMessage],
    fmt: ToolCallFormat | None = None,
    named_roles: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Messages as chat templates take them: roles system/user/assistant/tool, text content (an
    assistant turn's `refusal` where its content is null), a `name` in `named_roles` (in another
    role the template writes none: served as OpenAI-compatible servers do, see docs), an assistant turn's `tool_calls` with
    arguments as objects, a tool turn's `tool_call_id`."""
    if not messages:
        raise BadRequest("messages must contain at least one message", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(
            f"messages must contain at most {MAX_MESSAGES} messages, got {len(messages)}",
            param="messages",
        )
    return [_message(m, i, fmt, named_roles) for i, m in enumerate(messages)]


def _message(
    m: ChatMessage, i: int, fmt: ToolCallFormat | None, named_roles: frozenset[str]
) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    if role not in ROLES:
        raise BadRequest(
            f"messages[{i}].role '{m.role}' is not supported", param=f"messages[{i}].role"
        )
    out: dict[str, Any] = {"role": role, "content": _content(m, i)}
    if m.name is not None and role in named_roles:
        out["name"] = m.name
    if m.tool_calls:
        if role != "assistant":
            raise BadRequest(
                "only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls"
            )
        calls = template_tool_calls(m.tool_calls, fmt, f"messages[{i}].tool_calls")
        out["tool_calls"] = calls
    if role == "tool":
        if not m.tool_call_id:
            raise BadRequest(
                "a tool message names the call it answers", param=f"messages[{i}].tool_call_id"
            )
        return template_tool_result(m.tool_call_id, out["content"], fmt)
    return out


def _content(m: ChatMessage, i: int) -> str:
    """The turn's text: its content, or the `refusal` of an assistant turn whose content is
    null (OpenAI's refused answer, sent back as the SDK gave it). A refusal beside content is
    refused, as a refusal content part is (`_text`): the template has one text per turn."""
    if m.refusal is None:
        return _text(m.content, i)
    if m.role != "assistant":
        raise BadRequest("only assistant messages carry a refusal", param=f"messages[{i}].refusal")
    if m.content is not None:
        raise BadRequest(
            "an assistant message carries content or a refusal, not both",
            param=f"messages[{i}].refusal",
        )
    return m.refusal


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


def _completion_prompt(
    prompt: str | list[Any], vocab_size: int, nested: bool = False
) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise BadRequest(
                f"prompt token ids must be from 0 to {vocab_size - 1}, this model's vocabulary",
                param="prompt",
            )
        return {"prompt_token_ids": list(prompt)}
    if len(prompt) == 1 and not nested and isinstance(prompt[0], str | list):
        return _completion_prompt(prompt[0], vocab_size, nested=True)
    raise BadRequest(
        "prompt must be a string, a list of token ids, or a list holding one of those",
        param="prompt",
    )
