"""Streaming tool calls: whatever the deltas' split points, the streamed content and tool-call
deltas reassemble to exactly the non-streamed parse of the same text, and text that might open a
call is held back until it is decided."""

from __future__ import annotations

import random

import pytest

from loramux.gateway.openai.tools import (
    StreamDelta,
    ToolCallDelta,
    ToolCallFormat,
    ToolCallStreamParser,
    parse_tool_calls,
)
from tests.gateway.openai.tools.reassembly import reassemble
from tests.gateway.openai.tools.samples import SAMPLES

F = ToolCallFormat


def stream(
    text: str, fmt: ToolCallFormat, cuts: list[int], parallel: bool = True
) -> list[StreamDelta]:
    parser = ToolCallStreamParser(fmt, "req_1", parallel=parallel)
    deltas: list[StreamDelta] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        deltas += parser.feed(text[a:b])
    return deltas + parser.finish()


CASES = [(fmt, text) for fmt, texts in SAMPLES.items() for text in texts]


@pytest.mark.parametrize(("fmt", "text"), CASES)
def test_streamed_deltas_reassemble_to_the_whole_parse_at_any_split(
    fmt: ToolCallFormat, text: str
) -> None:
    whole = parse_tool_calls(text, fmt, "req_1")
    rng = random.Random(f"{fmt}:{text}")
    splits = [[], list(range(1, len(text)))]  # one delta; one character per delta
    for _ in range(60):
        k = rng.randint(1, min(12, max(1, len(text) - 1)))
        splits.append(sorted(rng.sample(range(1, len(text)), k)) if len(text) > 1 else [])
    for cuts in splits:
        for parallel in (True, False):
            expected = parse_tool_calls(text, fmt, "req_1", parallel=parallel)
            assert reassemble(stream(text, fmt, cuts, parallel)) == expected, cuts
    assert reassemble(stream(text, fmt, [])) == whole


def test_a_partial_opening_marker_is_held_until_decided() -> None:
    parser = ToolCallStreamParser(F.HERMES, "r")
    assert parser.feed("Hello <tool_c") == ["Hello"]
    assert parser.feed("all") == []
    assert parser.feed("ed it") == [" <tool_called it"]
    assert parser.finish() == []


def test_content_before_a_call_streams_before_the_call_completes() -> None:
    parser = ToolCallStreamParser(F.HERMES, "r")
    assert parser.feed("Checking.") == ["Checking."]
    assert parser.feed('\n<tool_call>\n{"name": "f", ') == []
    deltas = parser.feed('"arguments": {"a": 1}}\n</tool_call>\n')
    assert [type(d) for d in deltas] == [ToolCallDelta, ToolCallDelta]
    first, second = deltas
    assert isinstance(first, ToolCallDelta) and isinstance(second, ToolCallDelta)
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0,
        "function",
        "f",
        "",
    )
    assert second.function.arguments == '{"a": 1}'
    assert parser.finish() == []  # the whitespace around the call is not content
    assert parser.result().content == "Checking."


def test_plain_text_streams_as_it_comes_for_every_family() -> None:
    for fmt in (F.HERMES, F.LLAMA3_JSON, F.MISTRAL):
        parser = ToolCallStreamParser(fmt, "r")
        assert parser.feed("The answer") == ["The answer"]
        assert parser.feed(" is 4.") == [" is 4."]
        assert parser.finish() == []


def test_trailing_whitespace_without_calls_is_kept() -> None:
    parser = ToolCallStreamParser(F.HERMES, "r")
    assert parser.feed("Done.\n") == ["Done."]
    assert parser.finish() == ["\n"]


def test_feeding_a_long_region_one_character_at_a_time_stays_linear() -> None:
    # A quadratic parser would take minutes here; this one takes a fraction of a second.
    body = '{"name": "f", "arguments": {"blob": "' + "x" * 200_000 + '"}}'
    parser = ToolCallStreamParser(F.HERMES, "r")
    out: list[StreamDelta] = []
    for ch in "<tool_call>" + body + "</tool_call>":
        out += parser.feed(ch)
    out += parser.finish()
    assert len(out) == 2 and len(parser.calls) == 1


PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g", "parameters": {}}',
    '[{"name": "h", "arguments": {}}]',
    "{",
    "}",
    "[",
    "]",
    ";",
    '"',
    "\\",
    " ",
    "\n",
    "text",
    "é東",
    "\ud800",
]


@pytest.mark.parametrize("fmt", list(F))
def test_random_junk_never_fails_keeps_its_text_and_streams_like_the_whole_parse(
    fmt: ToolCallFormat,
) -> None:
    rng = random.Random(str(fmt))
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        whole = parse_tool_calls(text, fmt, "req_1")
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1))) if text else []
        assert reassemble(stream(text, fmt, cuts)) == whole, (text, cuts)
        if not whole.calls:
            assert whole.content == text  # nothing is lost or added
        for call in whole.calls:
            call.function.arguments.encode("utf-8")
