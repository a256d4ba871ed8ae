"""Tool calling on the wire, in OpenAI's shapes: what a request offers (`tools`, `tool_choice`,
`parallel_tool_calls`), the calls an assistant turn holds, and the deltas a stream sends.

The structs decode with msgspec (the openai request structs embed them); `checked_tools` applies
OpenAI's rules that a type cannot say, each refusal a 400 naming its `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from loramux.adapters.peft_format import nesting_depth
from loramux.gateway.errors import BadRequest

MAX_TOOLS = 128
"""OpenAI's limit on the functions one request may offer."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays in one function's `parameters` (a realistic schema
needs a dozen: each nested object adds `properties` and the property)."""
FunctionName = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
"""OpenAI's rule for a function's name: it keeps control-token text out of names."""


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema for the arguments object; omitted means the function takes none."""
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str
    """The arguments object as JSON text, as OpenAI sends it."""


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """One call in an assistant message's `tool_calls`: in a request's history and in a response."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """One streamed piece of a call (`choices[i].delta.tool_calls[j]`): the first piece of a call
    carries its index, id, type and name with empty arguments; later pieces carry argument text
    to append, under the same index."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: Literal["function"] | None = None


def checked_tools(
    tools: list[Tool] | None, tool_choice: ToolChoice | None
) -> tuple[list[Tool], ToolChoice]:
    """`tools` and the effective `tool_choice` (OpenAI's default: "auto" with tools, "none"
    without), after the rules a type cannot express. Raises BadRequest naming the param."""
    if tools is not None and not tools:
        raise BadRequest("tools must hold at least one function when given", param="tools")
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"at most {MAX_TOOLS} tools may be given, not {len(tools)}", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.function
        if function.name in names:
            raise BadRequest(
                f"two tools are named {function.name!r}", param=f"tools[{i}].function.name"
            )
        names.add(function.name)
        if function.parameters is not None:
            _check_parameters(function.parameters, f"tools[{i}].function.parameters")
    if tool_choice is None:
        return tools, "auto" if tools else "none"
    if not tools and tool_choice != "none":
        raise BadRequest("tool_choice needs tools to choose from", param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise BadRequest(
            f"tool_choice names {tool_choice.function.name!r}, which is not among the tools",
            param="tool_choice",
        )
    return tools, tool_choice


def _check_parameters(schema: dict[str, Any], param: str) -> None:
    """Refuse parameters that plainly cannot describe an object: a `type` other than object, a
    `const` or an `enum` that holds no object. Others without a `type` (an `anyOf`, a `$ref`)
    are held to an object when a call is forced (gateway.openai.tools.forced), where those that
    allow none are unsatisfiable, also a 400."""
    enum = schema.get("enum", [{}])
    if (
        schema.get("type", "object") != "object"
        or not isinstance(schema.get("const", {}), dict)
        or not (isinstance(enum, list) and any(isinstance(v, dict) for v in enum))
    ):
        raise BadRequest(
            "a function's parameters must be a JSON Schema of type object", param=param
        )
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise BadRequest(
            f"a function's parameters may nest at most {MAX_SCHEMA_DEPTH} levels deep", param=param
        )
