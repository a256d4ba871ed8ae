"""`tool_choice` required and named: the schema generation is held to accepts exactly the calls
OpenAI allows, and what it accepts parses back into tool calls. Validated with a JSON Schema
library (jsonschema_rs, Draft 2020-12)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import msgspec
import pytest

from loramux.engine.structured import StructuredOutput
from loramux.engine.structured.schema import check_error
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


REFERRING = {
    "type": "object",
    "properties": {
        "a": {"$ref": "#/$defs/Point"},
        "name": {"type": "integer", "minimum": 0},
        "b": {"$ref": "#/properties/name"},
        "old": {"$ref": "#/definitions/Flag"},
        "const": {"$ref": "#/$defs/Point"},
        "tree": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        "tag": {"const": {"$ref": "#/$defs/Point"}},
    },
    "required": ["a"],
    "additionalProperties": False,
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    "definitions": {"Flag": {"type": "boolean"}},
}
"""Parameters whose `$ref`s point into themselves, as a standalone schema reads them: Pydantic's
`$defs`, draft-07's `definitions`, a property, the root; a property named like a keyword; and
a `const` whose value merely looks like a reference."""
REFERRING_TOOLS = msgspec.convert(
    [
        {"type": "function", "function": {"name": name, "parameters": REFERRING}}
        for name in ("first", "second")
    ],
    list[Tool],
)
REFERRING_ARGUMENTS = [
    ({"a": {"x": 1}}, True),
    ({"a": {"x": 1}, "name": 3, "b": 4, "old": True, "const": {"x": 2}}, True),
    ({"a": {"x": 1}, "tree": [{"a": {"x": 2}, "tree": []}]}, True),
    ({"a": {"x": 1}, "tag": {"$ref": "#/$defs/Point"}}, True),
    ({"a": {"x": "one"}}, False),
    ({"a": {"x": 1}, "b": "second"}, False),
    ({"a": {"x": 1}, "old": 1}, False),
    ({"a": {"x": 1}, "const": {"x": "y"}}, False),
    ({"a": {"x": 1}, "tree": [{"a": {"x": "z"}}]}, False),
    ({"a": {"x": 1}, "tag": {"x": 1}}, False),
]


@pytest.mark.parametrize(
    ("choice", "parallel", "call"),
    [
        (NamedToolChoice("function", NamedFunction("second")), True, lambda c: c),
        ("required", True, lambda c: [c]),
        ("required", False, lambda c: c),
    ],
    ids=["named", "required", "required-one-call"],
)
def test_references_in_parameters_resolve_as_in_the_parameters_alone(
    choice: Any, parallel: bool, call: Any
) -> None:
    """A forced call's arguments are valid exactly when they are valid against the function's
    parameters alone, whatever those refer to, and the grammar library compiles the schema.
    The bug: the parameters were nested in the call's schema with their references unchanged,
    so "#/$defs/..." pointed at nothing (a 400 for Pydantic's schemas) and "#/properties/name"
    at the call's own `name`, the function's name."""
    schema = forced_call_schema(REFERRING_TOOLS, choice, parallel)
    alone = jsonschema_rs.validator_for(REFERRING)
    v = validator(schema)
    for arguments, valid in REFERRING_ARGUMENTS:
        assert alone.is_valid(arguments) is valid, arguments
        assert v.is_valid(call({"name": "second", "arguments": arguments})) is valid, arguments
    assert check_error(StructuredOutput("json_schema", schema)) is None


def test_references_under_an_id_resolve_against_it() -> None:
    """Parameters with an `$id` are a resource of their own: their references already resolve
    against them inside the call's schema, and are left as written."""
    parameters = REFERRING | {"$id": "https://example.com/referring"}
    tools = msgspec.convert(
        [{"type": "function", "function": {"name": "f", "parameters": parameters}}], list[Tool]
    )
    schema = forced_call_schema(tools, NamedToolChoice("function", NamedFunction("f")), True)
    assert json.loads(schema or "")["properties"]["arguments"] == parameters
    v = validator(schema)
    for arguments, valid in REFERRING_ARGUMENTS:
        assert v.is_valid({"name": "f", "arguments": arguments}) is valid, arguments
    assert check_error(StructuredOutput("json_schema", schema or "")) is None


def test_a_reference_the_parameters_cannot_resolve_stays_unresolvable() -> None:
    """A reference to nothing in the parameters is not made to point into the call's schema:
    the grammar library refuses it (the gateway's 400)."""
    parameters = {"type": "object", "properties": {"a": {"$ref": "#/properties/arguments"}}}
    tools = msgspec.convert(
        [{"type": "function", "function": {"name": "f", "parameters": parameters}}], list[Tool]
    )
    schema = forced_call_schema(tools, NamedToolChoice("function", NamedFunction("f")), True)
    assert schema is not None
    assert "does not exist" in (check_error(StructuredOutput("json_schema", schema)) or "")


UNTYPED = {
    "$ref": "#/$defs/P",
    "$defs": {"P": {"anyOf": [{"type": "integer"}, {"properties": {"n": {"type": "integer"}}}]}},
}
"""Parameters without a `type`, that allow an object and other values."""


@pytest.mark.parametrize(
    ("choice", "parallel", "call"),
    [
        (NamedToolChoice("function", NamedFunction("f")), True, lambda c: c),
        ("required", True, lambda c: [c]),
    ],
    ids=["named", "required"],
)
def test_arguments_of_parameters_without_a_type_are_held_to_an_object(
    choice: Any, parallel: bool, call: Any
) -> None:
    """The bug: such parameters constrained the arguments as they were, so a forced call's
    arguments could be `1`, which is no call (it came back as content)."""
    tools = msgspec.convert(
        [{"type": "function", "function": {"name": "f", "parameters": UNTYPED}}], list[Tool]
    )
    schema = forced_call_schema(tools, choice, parallel)
    assert schema is not None and check_error(StructuredOutput("json_schema", schema)) is None
    v = validator(schema)
    assert v.is_valid(call({"name": "f", "arguments": {"n": 1}}))
    for arguments in (1, {"n": "x"}, [1], None):
        assert not v.is_valid(call({"name": "f", "arguments": arguments})), arguments


@pytest.mark.parametrize("choice", [NamedToolChoice("function", NamedFunction("f")), "required"])
def test_parameters_that_allow_no_object_make_the_forced_schema_unsatisfiable(
    choice: Any,
) -> None:
    """What the gateway refuses (400 on `tools`) instead of constraining output to a non-call."""
    parameters = {
        "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/S"}],
        "$defs": {"S": {"type": "string"}},
    }
    tools = msgspec.convert(
        [{"type": "function", "function": {"name": "f", "parameters": parameters}}], list[Tool]
    )
    schema = forced_call_schema(tools, choice, True) or ""
    assert "nsatisfiable" in (check_error(StructuredOutput("json_schema", schema)) or "")


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


@pytest.mark.parametrize(
    "arguments",
    ['{"n":' + "9" * 4301 + "}", '{"x":9999e9999}', '{"x":0.10000000000000000555,"y":-0E-0}'],
)
def test_a_forced_output_is_a_call_whose_arguments_are_the_models_own_text(
    arguments: str,
) -> None:
    """A constrained output is JSON of its schema, so a call, whatever numbers it holds; its
    arguments are the text the model wrote. The bugs: an integer of more than 4,300 digits
    (past Python's limit) made the output no call, returned as content; `9999e9999` came back
    as `Infinity` (not JSON) and `0.10000000000000000555` as `0.1`."""
    parsed = parse_forced_output('{"name":"f","arguments":' + arguments + "}", "req_1")
    assert [(c.function.name, c.function.arguments) for c in parsed.calls] == [("f", arguments)]
    assert parsed.content is None


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
