"""The tool fields of a request, as OpenAI defines them: decoded by type, then checked by the
rules a type cannot say. Every refusal is a 400 that names the param at fault."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from loramux.gateway.errors import BadRequest
from loramux.gateway.openai.tools import (
    FunctionCallDelta,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    checked_tools,
)
from loramux.gateway.openai.tools.schemas import MAX_SCHEMA_DEPTH, MAX_TOOLS


class Body(msgspec.Struct):
    """The tool fields as a request struct embeds them."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


def tool(name: str = "get_weather", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": "Current weather"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def decode(**fields: Any) -> Body:
    return msgspec.convert(fields, Body)


def refusal(**fields: Any) -> BadRequest:
    body = decode(**fields)
    with pytest.raises(BadRequest) as caught:
        checked_tools(body.tools, body.tool_choice)
    assert caught.value.status == 400
    return caught.value


def test_openai_shapes_decode() -> None:
    body = decode(
        tools=[tool(parameters=PARAMS), tool("get_time")],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
    )
    assert body.tools is not None and body.tools[0].function.parameters == PARAMS
    assert body.tool_choice == NamedToolChoice("function", body.tool_choice.function)  # type: ignore[union-attr]
    for choice in ("none", "auto", "required"):
        assert decode(tool_choice=choice).tool_choice == choice


def test_defaults_are_auto_with_tools_and_none_without() -> None:
    body = decode(tools=[tool()])
    assert checked_tools(body.tools, None)[1] == "auto"
    assert checked_tools(None, None) == ([], "none")
    assert checked_tools(None, "none") == ([], "none")


@pytest.mark.parametrize(
    "name",
    ["", "x" * 65, "has space", "<|im_start|>", "</tool_call>", "naïve", "a.b", "[TOOL_CALLS]"],
)
def test_function_names_outside_openais_rule_are_refused_by_type(name: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=r"tools\[0\]\.function\.name"):
        decode(tools=[tool(name)])


def test_unknown_tool_types_and_fields_are_refused_by_type() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(tools=[{"type": "retrieval", "function": {"name": "f"}}])
    with pytest.raises(msgspec.ValidationError):
        decode(tools=[{"type": "function", "function": {"name": "f", "parameterz": {}}}])
    with pytest.raises(msgspec.ValidationError):
        decode(tool_choice="sometimes")


def test_more_than_128_tools_are_refused() -> None:
    err = refusal(tools=[tool(f"f{i}") for i in range(MAX_TOOLS + 1)])
    assert err.param == "tools"
    assert checked_tools(decode(tools=[tool(f"f{i}") for i in range(MAX_TOOLS)]).tools, None)


def test_an_empty_tools_list_is_refused() -> None:
    assert refusal(tools=[]).param == "tools"


def test_duplicate_names_are_refused() -> None:
    assert refusal(tools=[tool(), tool()]).param == "tools[1].function.name"


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "string"},
        {"type": "array", "items": {}},
        {"enum": [1, 2]},
        {"enum": 5},
        {"const": "x"},
    ],
)
def test_parameters_must_be_an_object_schema(parameters: dict[str, Any]) -> None:
    err = refusal(tools=[tool(), tool("g", parameters)])
    assert err.param == "tools[1].function.parameters"


@pytest.mark.parametrize(
    "parameters", [{}, {"enum": [{"a": 1}, 2]}, {"anyOf": [{"type": "object"}]}, {"$ref": "#"}]
)
def test_parameters_without_a_type_that_may_be_an_object_are_taken(
    parameters: dict[str, Any],
) -> None:
    body = decode(tools=[tool(parameters=parameters)], tool_choice="required")
    assert checked_tools(body.tools, body.tool_choice)[1] == "required"


def test_deeply_nested_parameters_are_refused_without_recursion() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(10_000):
        deep = {"type": "object", "properties": {"a": deep}}
    err = refusal(tools=[tool(parameters=deep)])
    assert err.param == "tools[0].function.parameters"
    assert str(MAX_SCHEMA_DEPTH) in err.message


def test_tool_choice_needs_tools() -> None:
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        assert refusal(tool_choice=choice).param == "tool_choice"


def test_a_named_tool_choice_must_name_a_listed_tool() -> None:
    err = refusal(
        tools=[tool()], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert err.param == "tool_choice"
    assert "get_time" in err.message


def test_assistant_tool_calls_decode_in_openais_shape() -> None:
    call = msgspec.convert(
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ToolCall,
    )
    assert msgspec.to_builtins(call) == {
        "id": "call_1",
        "function": {"name": "f", "arguments": "{}"},
        "type": "function",
    }


def test_stream_deltas_encode_as_openai_chunks_write_them() -> None:
    first = ToolCallDelta(
        0, FunctionCallDelta(name="f", arguments=""), id="call_1", type="function"
    )
    later = ToolCallDelta(0, FunctionCallDelta(arguments='{"a": 1}'))
    assert msgspec.json.decode(msgspec.json.encode([first, later])) == [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "f", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"a": 1}'}},
    ]
