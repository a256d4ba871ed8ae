"""`tool_choice` "required" and a named function: generation constrained to calls.

The engine's structured output (`StructuredOutput(kind="json_schema")`) holds the model to the
JSON schema built here, so the output *is* the calls, in the JSON format:
- a named function: one object `{"name": <that name>, "arguments": <its parameters schema>}`;
- "required": an array of one or more such objects, each any of the tools (a single object
  when `parallel_tool_calls` is false).
"auto" and "none" constrain nothing. With "none" the tools are still rendered into the prompt
(as vLLM does by default) and the output is not read for calls: the model sees the same prompt
either way, and the request asks it not to call.

Each tool's `parameters` is a schema of its own: its local `$ref`s ("#/$defs/X", as Pydantic
writes them; "#/properties/a"; "#") point into it, not into the wrapper built around it. So
they are rewritten to the place the parameters take in the wrapper ("#/$defs/X" under a named
function becomes "#/properties/arguments/$defs/X"), and resolve as they would standalone. Those
under an `$id` already do, and other references (another document, an anchor) are left as
written: if the grammar library cannot resolve them, the request is refused (400) like any
schema it cannot compile.
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
        return json.dumps(_call_schema(tool, ""))
    if tool_choice != "required":
        return None
    at = "" if not parallel else "/items"
    one_call: dict[str, Any] = {
        "anyOf": [_call_schema(t, f"{at}/anyOf/{i}") for i, t in enumerate(tools)]
    }
    if not parallel:
        return json.dumps(one_call)
    return json.dumps({"type": "array", "items": one_call, "minItems": 1})


def parse_forced_output(text: str, calls_of: str) -> ParsedToolCalls:
    """The calls in a constrained output. An output cut short (max_tokens) holds no complete
    JSON: it is returned as content with no calls."""
    return parse_tool_calls(text, ToolCallFormat.JSON, calls_of)


def _call_schema(tool: Tool, at: str) -> dict[str, Any]:
    """One call of `tool`, the object being at JSON pointer `at` in the whole schema."""
    function = tool.function
    parameters = function.parameters if function.parameters is not None else NO_PARAMETERS
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            "arguments": _object_arguments(parameters, f"{at}/properties/arguments"),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _object_arguments(parameters: dict[str, Any], at: str) -> dict[str, Any]:
    """The arguments' schema, at JSON pointer `at`: `parameters`, held to a JSON object. Those
    of type object are one already; others (no `type`: an `enum`, an `anyOf`, a `$ref`) sit
    under `allOf` with `{"type": "object"}`, so a call's arguments are an object whatever they
    say, and parameters that allow no object make the schema unsatisfiable (a 400 on `tools`),
    never a constrained output that is no call."""
    if parameters.get("type") == "object":
        return _moved_refs(parameters, at)
    return {"allOf": [{"type": "object"}, _moved_refs(parameters, f"{at}/allOf/1")]}


DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are JSON data, not schemas: a "$ref" key in them is data."""
SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
"""Keywords whose values map names to schemas: each is a schema, whatever its name."""


def _moved_refs(schema: Any, at: str) -> Any:
    """A copy of `schema` (a schema, or a list of them) as it reads at JSON pointer `at` of a
    larger schema: each local JSON-pointer `$ref` ("#", "#/...") gets `at` put in front of its
    pointer. Data (`const`, `enum`, ...) is copied as it is, and so is a schema with an `$id`:
    the references in it resolve against it, wherever it is."""
    if isinstance(schema, list):
        return [_moved_refs(item, at) for item in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved[key] = "#" + at + value[1:]
        elif key in DATA_KEYWORDS:
            moved[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            moved[key] = {name: _moved_refs(sub, at) for name, sub in value.items()}
        else:
            moved[key] = _moved_refs(value, at)
    return moved
