"""`tool_choice` required and named: the schema generation is held to accepts exactly the calls
OpenAI allows, and what it accepts parses back into tool calls. Validated with a JSON Schema
library (jsonschema_rs, Draft 2020-12)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import msgspec
import pytest

from loramux.gateway.errors import BadRequest
from loramux.gateway.openai.tools import (
    NO_TOOLS,
    NamedToolChoice,
    Tool,
    ToolCallFormat,
    forced_call_schema,
    parse_forced_output,
    tool_plan,
)
from loramux.gateway.openai.tools.schemas import NamedFunction

TOOLS = msgspec.convert(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    },
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ],
    list[Tool],
)
NAMED = NamedToolChoice("function", NamedFunction("get_weather"))


def validator(schema: str | None) -> Any:
    assert schema is not None
    parsed = json.loads(schema)
    assert jsonschema_rs.meta.is_valid(parsed)
    return jsonschema_rs.validator_for(parsed)


WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
TIME = {"name": "get_time", "arguments": {}}


def test_a_named_function_forces_one_call_of_it_with_valid_arguments() -> None:
    v = validator(forced_call_schema(TOOLS, NAMED, parallel=True))
    assert v.is_valid(WEATHER)
    assert v.is_valid({"name": "get_weather", "arguments": {"city": "Paris"}})
    for wrong in (
        TIME,
        [WEATHER],
        {"name": "get_weather", "arguments": {"city": 3}},
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 8}},
        {"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}},
        {"name": "get_weather"},
        {"name": "get_weather", "arguments": {"city": "x"}, "more": 1},
    ):
        assert not v.is_valid(wrong), wrong


def test_required_forces_one_or_more_calls_of_any_tool() -> None:
    v = validator(forced_call_schema(TOOLS, "required", parallel=True))
    assert v.is_valid([WEATHER])
    assert v.is_valid([WEATHER, TIME, TIME])
    assert not v.is_valid([])
    assert not v.is_valid(WEATHER)
    assert not v.is_valid([{"name": "get_time", "arguments": {"x": 1}}])  # takes no arguments
    assert not v.is_valid([{"name": "other", "arguments": {}}])


def test_required_without_parallel_calls_forces_exactly_one_call() -> None:
    v = validator(forced_call_schema(TOOLS, "required", parallel=False))
    assert v.is_valid(WEATHER) and v.is_valid(TIME)
    assert not v.is_valid([WEATHER])


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_force_nothing(choice: str) -> None:
    assert forced_call_schema(TOOLS, choice, parallel=True) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("output", [WEATHER, [WEATHER, TIME]])
def test_forced_output_parses_into_tool_calls(output: Any) -> None:
    parsed = parse_forced_output(json.dumps(output), "req_1")
    expected = output if isinstance(output, list) else [output]
    assert parsed.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        (e["name"], e["arguments"]) for e in expected
    ]


def test_forced_output_cut_short_is_content_without_calls() -> None:
    text = '[{"name": "get_weather", "arguments": {"ci'
    parsed = parse_forced_output(text, "req_1")
    assert (parsed.content, parsed.calls) == (text, [])


def test_the_plan_renders_tools_and_reads_calls_per_tool_choice() -> None:
    auto = tool_plan(TOOLS, None, None, ToolCallFormat.HERMES)
    assert auto.template_tools == [msgspec.to_builtins(t) for t in TOOLS]
    assert (auto.output_format, auto.forced_schema, auto.parallel) == (
        ToolCallFormat.HERMES,
        None,
        True,
    )
    none = tool_plan(TOOLS, "none", None, ToolCallFormat.HERMES)
    assert none.template_tools == auto.template_tools and not none.reads_calls
    named = tool_plan(TOOLS, NAMED, False, None)  # forced works without template support
    assert named.output_format is ToolCallFormat.JSON and named.forced_schema is not None
    assert tool_plan(None, None, None, None) == NO_TOOLS


def test_auto_on_a_model_whose_template_writes_no_calls_is_refused() -> None:
    with pytest.raises(BadRequest) as caught:
        tool_plan(TOOLS, "auto", None, None)
    assert caught.value.param == "tools"
