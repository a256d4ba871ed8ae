"""Reading tool calls out of whole outputs, per model family: well-formed calls become
`tool_calls` with the text around them as content; junk stays content and is never an error."""

from __future__ import annotations

import json

import pytest

from loramux.gateway.openai.tools import ToolCallFormat, call_id, parse_tool_calls
from tests.gateway.openai.tools.samples import HERMES_SAMPLES, LLAMA3_SAMPLES, MISTRAL_SAMPLES

F = ToolCallFormat


def calls(text: str, fmt: ToolCallFormat, **kw: bool) -> list[tuple[str, dict[str, object]]]:
    return [
        (c.function.name, json.loads(c.function.arguments))
        for c in parse_tool_calls(text, fmt, "req_1", **kw).calls
    ]


WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"zone": "Europe/Paris"})


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        (HERMES_SAMPLES[0], None, [WEATHER]),
        (HERMES_SAMPLES[1], None, [WEATHER, TIME]),
        (HERMES_SAMPLES[2], "Let me check the weather for you.", [WEATHER]),
        (HERMES_SAMPLES[3], "<tool_call>\n{name: get_weather}\n</tool_call>", [TIME]),
        (HERMES_SAMPLES[4], HERMES_SAMPLES[4], []),
        (HERMES_SAMPLES[5], HERMES_SAMPLES[5], []),
        (HERMES_SAMPLES[6], None, [TIME]),
        (HERMES_SAMPLES[7], "Voilà —  ✓", [("get_weather", {"city": "Zürich 東京"})]),
    ],
)
def test_hermes_tags_hold_calls_and_the_rest_is_content(
    text: str, content: str | None, expected: list[object]
) -> None:
    parsed = parse_tool_calls(text, F.HERMES, "req_1")
    assert parsed.content == content
    assert calls(text, F.HERMES) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (LLAMA3_SAMPLES[0], [WEATHER]),
        (LLAMA3_SAMPLES[1], [TIME]),
        (LLAMA3_SAMPLES[2], [WEATHER, TIME]),
        (LLAMA3_SAMPLES[3], [TIME]),
        (LLAMA3_SAMPLES[4], []),
        (LLAMA3_SAMPLES[5], []),
        (LLAMA3_SAMPLES[6], []),
    ],
)
def test_llama3_json_output_is_calls_when_it_is_all_calls(
    text: str, expected: list[object]
) -> None:
    parsed = parse_tool_calls(text, F.LLAMA3_JSON, "req_1")
    assert calls(text, F.LLAMA3_JSON) == expected
    assert parsed.content == (None if expected else text)


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        (MISTRAL_SAMPLES[0], None, [WEATHER]),
        (MISTRAL_SAMPLES[1], None, [WEATHER, TIME]),
        (MISTRAL_SAMPLES[2], None, [TIME]),
        (MISTRAL_SAMPLES[3], "Sure.", [TIME]),
        (MISTRAL_SAMPLES[4], MISTRAL_SAMPLES[4], []),
        (MISTRAL_SAMPLES[5], MISTRAL_SAMPLES[5], []),
    ],
)
def test_mistral_tool_calls_marker_opens_an_array_of_calls(
    text: str, content: str | None, expected: list[object]
) -> None:
    assert parse_tool_calls(text, F.MISTRAL, "req_1").content == content
    assert calls(text, F.MISTRAL) == expected


def test_call_ids_are_deterministic_per_request_and_index_and_distinct() -> None:
    parsed = parse_tool_calls(HERMES_SAMPLES[1], F.HERMES, "req_1")
    assert [c.id for c in parsed.calls] == [call_id("req_1", 0), call_id("req_1", 1)]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.calls)
    other = parse_tool_calls(HERMES_SAMPLES[1], F.HERMES, "req_2")
    assert {c.id for c in parsed.calls}.isdisjoint(c.id for c in other.calls)


def test_without_parallel_calls_only_the_first_call_counts() -> None:
    assert calls(HERMES_SAMPLES[1], F.HERMES, parallel=False) == [WEATHER]
    assert calls(MISTRAL_SAMPLES[1], F.MISTRAL, parallel=False) == [WEATHER]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "", "arguments": {}}',  # empty name
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1]}',  # arguments not an object
        '{"name": "f", "arguments": "not json"}',
        '{"arguments": {}}',
        "[]",
        "null",
        '{"name": "f", "arguments": {}} trailing words',
        '{"name": "f", "arguments": {"a": NaN}} x',
        '{"name": "f", "arguments": {"a": NaN}}',  # not JSON (RFC 8259)
        '{"name": "f", "arguments": {"a": -Infinity}}',
        '{"name": "f", "arguments": "{\\"a\\": Infinity}"}',
        '{"name": "f", "arguments": {"a": 1}',  # unclosed
        '{"name": "f" "arguments": {}}',
        '{"name": "f", "arguments": {},}',
        '[{"name": "f", "arguments": {}}, 1]',
        '[{"name": "f", "arguments": {}},]',
    ],
)
def test_malformed_calls_stay_content(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    parsed = parse_tool_calls(text, F.HERMES, "r")
    assert parsed.calls == []
    assert parsed.content == text


def test_arguments_written_as_a_json_string_are_read_as_the_object() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert calls(text, F.HERMES) == [("f", {"a": 1})]


def test_nesting_past_the_decoders_stack_is_content_not_an_error() -> None:
    deep = '{"name": "f", "arguments": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001
    for text, fmt in ((f"<tool_call>{deep}</tool_call>", F.HERMES), (deep, F.LLAMA3_JSON)):
        parsed = parse_tool_calls(text, fmt, "r")
        assert parsed.calls == []
        assert parsed.content == text


def test_megabyte_arguments_parse_whole() -> None:
    big = "x" * 1_000_000
    text = '<tool_call>{"name": "f", "arguments": {"blob": "' + big + '"}}</tool_call>'
    (call,) = parse_tool_calls(text, F.HERMES, "r").calls
    assert json.loads(call.function.arguments) == {"blob": big}


@pytest.mark.parametrize(
    "arguments",
    [
        '{"s": "a\\ud800b", "t": "é"}',  # a lone surrogate's escape, in the model's text
        '"{\\"s\\": \\"a\\ud800b\\", \\"t\\": \\"é\\"}"',  # a lone surrogate, in the string
        '{"s": "a\ud800b", "t": "é"}',  # a lone surrogate itself
    ],
)
def test_arguments_holding_a_lone_surrogate_encode_as_utf8(arguments: str) -> None:
    text = '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"
    (call,) = parse_tool_calls(text, F.HERMES, "r").calls
    call.function.arguments.encode("utf-8")  # the response can be written
    assert json.loads(call.function.arguments) == {"s": "a\ud800b", "t": "é"}


@pytest.mark.parametrize(
    "arguments",
    [
        '{"x": 9999e9999}',
        '{"x": 0.10000000000000000555, "y": -0.0}',
        '{"n": ' + "1" * 5000 + "}",
        '{ "nested" : { "a" : [ 1.0 , 2E+2 ] } , "s" : "\\u00e9\\n" }',
    ],
)
@pytest.mark.parametrize("written_as", ["object", "string"])
def test_arguments_are_the_models_own_text_however_python_would_read_them(
    arguments: str, written_as: str
) -> None:
    """The arguments are the text the model wrote (of the object, or of the JSON string that
    holds it), never re-encoded: `9999e9999` became `Infinity` (not JSON), `0.10000000000000000555`
    became `0.1`, and an integer past 4,300 digits made the call no call at all."""
    written = arguments if written_as == "object" else json.dumps(arguments)
    text = '<tool_call>{"name": "f", "arguments": ' + written + "}</tool_call>"
    (call,) = parse_tool_calls(text, F.HERMES, "r").calls
    assert call.function.arguments == arguments


def test_non_ascii_arguments_are_written_as_they_are() -> None:
    (call,) = parse_tool_calls(HERMES_SAMPLES[7], F.HERMES, "r").calls
    assert call.function.arguments == '{"city": "Zürich 東京"}'
