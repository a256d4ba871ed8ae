"""`tool_choice` "required" and a named function: generation constrained to calls.

The engine's structured output (`StructuredOutput(kind="json_schema")`) holds the model to the
JSON schema built here, so the output *is* the calls, in the JSON format:
- a named function: one object `{"name": <that name>, "arguments": <its parameters schema>}`;
- "required": an array of one or more such objects, each any of the tools (a single object
  when `parallel_tool_calls` is false).
"auto" and "none" constrain nothing. With "none" the tools are still rendered into the prompt
(as vLLM does by default) and the output is not read for calls: the model sees the same prompt
either way, and the request asks it not to call.
"""

from __future__ import annotations

import json
from typing import Any

from loramux.gateway.openai.tools.formats import ParsedToolCalls, ToolCallFormat
from loramux.gateway.openai.tools.schemas import NamedToolChoice, Tool, ToolChoice
from loramux.gateway.openai.tools.stream import parse_tool_calls

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments schema of a function declared without `parameters`: it takes none."""


def forced_call_schema(tools: list[Tool], tool_choice: ToolChoice, parallel: bool) -> str | None:
    """The JSON schema (as JSON text) generation must follow; None when nothing is forced."""
    if isinstance(tool_choice, NamedToolChoice):
        (tool,) = [t for t in tools if t.function.name == tool_choice.function.name]
        return json.dumps(_call_schema(tool))
    if tool_choice != "required":
        return None
    one_call: dict[str, Any] = {"anyOf": [_call_schema(t) for t in tools]}
    if not parallel:
        return json.dumps(one_call)
    return json.dumps({"type": "array", "items": one_call, "minItems": 1})


def parse_forced_output(text: str, calls_of: str) -> ParsedToolCalls:
    """The calls in a constrained output. An output cut short (max_tokens) holds no complete
    JSON: it is returned as content with no calls."""
    return parse_tool_calls(text, ToolCallFormat.JSON, calls_of)


def _call_schema(tool: Tool) -> dict[str, Any]:
    function = tool.function
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            "arguments": function.parameters if function.parameters is not None else NO_PARAMETERS,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
