"""Tool turns of a conversation's history as chat templates take them.

Templates read an assistant turn's `tool_calls` as `{"id", "type", "function": {"name",
"arguments"}}` with the arguments as a mapping (they write it with `tojson`), and a tool result
as a message of role `tool` with `tool_call_id` and `content`. OpenAI clients send arguments as
JSON text, so it is decoded here; text that is not a JSON object is refused (a 400 naming where)
rather than rendered as a quoted string the model never wrote.

Mistral's template accepts only ids of exactly 9 letters and digits; for that format ids are
shortened to their last 9 (as vLLM does), consistently in calls and results.
"""

from __future__ import annotations

import json
import re
from typing import Any

from loramux.adapters.peft_format import nesting_depth
from loramux.gateway.errors import BadRequest
from loramux.gateway.openai.tools.formats import ToolCallFormat
from loramux.gateway.openai.tools.schemas import MAX_SCHEMA_DEPTH, ToolCall

MISTRAL_ID_LENGTH = 9
_NOT_ALNUM = re.compile(r"[^a-zA-Z0-9]")


def template_tool_calls(
    calls: list[ToolCall], fmt: ToolCallFormat | None, param: str
) -> list[dict[str, Any]]:
    """An assistant turn's calls for the template; `param` is where they are in the request
    (e.g. `messages[3].tool_calls`)."""
    return [
        {
            "id": template_call_id(call.id, fmt),
            "type": "function",
            "function": {
                "name": call.function.name,
                "arguments": _arguments(
                    call.function.arguments, f"{param}[{i}].function.arguments"
                ),
            },
        }
        for i, call in enumerate(calls)
    ]


def template_tool_result(
    tool_call_id: str, content: str, fmt: ToolCallFormat | None
) -> dict[str, Any]:
    """A `tool` message for the template."""
    return {"role": "tool", "tool_call_id": template_call_id(tool_call_id, fmt), "content": content}


def template_call_id(call_id: str, fmt: ToolCallFormat | None) -> str:
    if fmt is not ToolCallFormat.MISTRAL:
        return call_id
    return _NOT_ALNUM.sub("", call_id)[-MISTRAL_ID_LENGTH:].rjust(MISTRAL_ID_LENGTH, "0")


def _arguments(text: str, param: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text)
    except RecursionError:
        raise BadRequest(
            f"the arguments nest deeper than {MAX_SCHEMA_DEPTH} levels", param=param
        ) from None
    except ValueError as exc:
        raise BadRequest(f"the arguments are not valid JSON: {exc}", param=param) from None
    if not isinstance(arguments, dict):
        raise BadRequest("the arguments must be a JSON object", param=param)
    if nesting_depth(arguments, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise BadRequest(f"the arguments nest deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
    try:
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            "the arguments hold a lone UTF-16 surrogate escape (e.g. \\ud800), which is not text",
            param=param,
        ) from None
    return arguments
