"""How each model family writes a tool call in its output, and how to read one back.

Every family writes calls as JSON inside a *region* of its output:

| format | region | its JSON |
| --- | --- | --- |
| HERMES (Qwen2.5, Hermes, the demo model) | `<tool_call>` … `</tool_call>`, any number | `{"name", "arguments"}` |
| LLAMA3_JSON (Llama 3.1–3.3) | the whole output when it starts with `{` or `<\\|python_tag\\|>` | `{"name", "parameters"}`, several split by `;` |
| MISTRAL (Mistral v0.3, Nemo) | after `[TOOL_CALLS]`, or the whole output when it starts with `[` | `[{"name", "arguments"}, …]` |
| JSON (constrained `required`/named tool_choice) | the whole output | one call object, or an array of them |

A region whose JSON is not a list of well-formed calls is no call at all: its text (markers
included) stays content, so junk from a model is never an error. Mistral's and Llama's opening
markers are special tokens that a detokenizer skipping special tokens drops; the region also
opens on the bare JSON at the start of the output so such text still parses.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from typing import Any

from loramux.engine.chat_prompt import chat_template
from loramux.gateway.openai.tools.schemas import FunctionCall, ToolCall


class ToolCallFormat(StrEnum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    JSON = "json"

    @property
    def opens(self) -> tuple[str, ...]:
        """Markers that open a region wherever they appear."""
        return _OPENS[self]

    @property
    def opens_output(self) -> str | None:
        """First characters (after whitespace) that make the whole output a region; "" for JSON,
        whose output is always one region."""
        return _OPENS_OUTPUT[self]

    @property
    def closes(self) -> str | None:
        """The marker that ends a region; None where a region runs to the end of the output."""
        return "</tool_call>" if self is ToolCallFormat.HERMES else None


_OPENS = {
    ToolCallFormat.HERMES: ("<tool_call>",),
    ToolCallFormat.LLAMA3_JSON: ("<|python_tag|>",),
    ToolCallFormat.MISTRAL: ("[TOOL_CALLS]",),
    ToolCallFormat.JSON: (),
}
_OPENS_OUTPUT = {
    ToolCallFormat.HERMES: None,
    ToolCallFormat.LLAMA3_JSON: "{",
    ToolCallFormat.MISTRAL: "[",
    ToolCallFormat.JSON: "",
}


def tool_call_format(tokenizer_or_template: Any) -> ToolCallFormat | None:
    """The format the model's chat template teaches it, from the template's source (or a
    tokenizer's); None for a template that renders no tools."""
    template = tokenizer_or_template
    if not isinstance(template, str):
        template = chat_template(tokenizer_or_template)
    if "tools" not in template:
        return None
    if "[TOOL_CALLS]" in template:
        return ToolCallFormat.MISTRAL
    if "<tool_call>" in template:
        return ToolCallFormat.HERMES
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return ToolCallFormat.LLAMA3_JSON
    return None


@dataclass(frozen=True)
class ParsedToolCalls:
    """A finished output read as a message: the calls found, and the text around them. `content`
    is None when there are calls and no other text (whitespace around calls does not count)."""

    content: str | None
    calls: list[ToolCall]


def call_id(calls_of: str, index: int) -> str:
    """The id of call `index` of one choice, `call_` and 24 characters. Deterministic in
    `calls_of` (the request id and choice index), so a stream and a whole response of the same
    request agree; ids are unique while request ids are."""
    return "call_" + hashlib.sha256(f"{calls_of}#{index}".encode()).hexdigest()[:24]


def decode_calls(body: str) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON text) of each call in a region's JSON: call objects, arrays of
    them, separated by whitespace or `;`. None unless all of `body` is such calls (at least one).

    The arguments text is the model's own, as it wrote it (see `_members`), never a re-encoding
    of the decoded value: Python's numbers would change it (`9999e9999` became `Infinity`, which
    is not JSON; `0.10000000000000000555` became `0.1`), and would refuse an integer longer than
    4,300 digits, so such a call was no call at all."""
    calls: list[tuple[str, str]] = []
    at = _skip_separators(body, 0)
    while at < len(body):
        try:
            found, at = _calls_at(body, at)
        except (ValueError, RecursionError):
            return None
        if found is None:
            return None
        calls += found
        at = _skip_separators(body, at)
    return calls or None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_int=Decimal, parse_float=Decimal, parse_constant=_refuse_constant)
"""Reads JSON (RFC 8259: no NaN or Infinity) without Python's number limits; the values it
gives are only looked at, never written again."""

_SEPARATORS = re.compile(r"[\s;]*")
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip_separators(text: str, at: int) -> int:
    match = _SEPARATORS.match(text, at)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _skip_whitespace(text: str, at: int) -> int:
    match = _WHITESPACE.match(text, at)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _calls_at(text: str, at: int) -> tuple[list[tuple[str, str]] | None, int]:
    """The calls of the JSON value at `at` (one call object or an array of them; None if it is
    anything else), and where the value ends. ValueError where it is not JSON."""
    if not text.startswith("[", at):
        call, end = _call_at(text, at)
        return (None if call is None else [call]), end
    calls: list[tuple[str, str]] = []
    every_item_a_call = True
    at = _skip_whitespace(text, at + 1)
    if text.startswith("]", at):
        return calls, at + 1
    while True:
        call, at = _call_at(text, at)
        if call is None:
            every_item_a_call = False
        else:
            calls.append(call)
        at = _skip_whitespace(text, at)
        if text.startswith("]", at):
            return (calls if every_item_a_call else None), at + 1
        if not text.startswith(",", at):
            raise ValueError("expected , or ] in an array")
        at = _skip_whitespace(text, at + 1)


def _call_at(text: str, at: int) -> tuple[tuple[str, str] | None, int]:
    """The call the JSON value at `at` is (None if it is no call), and where the value ends."""
    if not text.startswith("{", at):
        _, end = _DECODER.raw_decode(text, at)
        return None, end
    members, end = _members(text, at)
    name = members.get("name")
    if name is None or not isinstance(name[0], str) or not name[0]:
        return None, end
    arguments = members.get("arguments", members.get("parameters"))
    if arguments is None:
        return (name[0], "{}"), end
    value, start, stop = arguments
    if isinstance(value, str):  # some models write the arguments as a JSON string
        arguments_text = value.strip(" \t\n\r")
        value = _DECODER.decode(arguments_text)
    else:
        arguments_text = text[start:stop]
    if not isinstance(value, dict):
        return None, end
    return (name[0], _utf8_safe(arguments_text)), end


def _members(text: str, at: int) -> tuple[dict[str, tuple[Any, int, int]], int]:
    """The members of the JSON object at `at`: each key's value with where its text starts and
    ends in `text` (the last of a repeated key, as `json.loads` keeps), and where the object
    ends. ValueError where it is not JSON."""
    members: dict[str, tuple[Any, int, int]] = {}
    at = _skip_whitespace(text, at + 1)
    if text.startswith("}", at):
        return members, at + 1
    while True:
        if not text.startswith('"', at):
            raise ValueError("expected a member's name")
        key, at = _DECODER.raw_decode(text, at)
        at = _skip_whitespace(text, at)
        if not text.startswith(":", at):
            raise ValueError("expected : after a member's name")
        start = _skip_whitespace(text, at + 1)
        value, at = _DECODER.raw_decode(text, start)
        members[key] = (value, start, at)
        at = _skip_whitespace(text, at)
        if text.startswith("}", at):
            return members, at + 1
        if not text.startswith(",", at):
            raise ValueError("expected , or } in an object")
        at = _skip_whitespace(text, at + 1)


def _utf8_safe(json_text: str) -> str:
    """`json_text` as it is, unless it holds a lone surrogate (a model's arguments written as a
    JSON string may, from a `\\ud800` escape), which UTF-8 cannot encode: each is then written
    as its JSON escape. In valid JSON a surrogate can only be inside a string, where the escape
    is the same value."""
    try:
        json_text.encode("utf-8")
    except UnicodeEncodeError:
        return json_text.encode("utf-8", "backslashreplace").decode("utf-8")
    return json_text


def tool_calls(named: list[tuple[str, str]], calls_of: str, first_index: int) -> list[ToolCall]:
    """ToolCall structs for decoded calls, numbered from `first_index` within their choice."""
    return [
        ToolCall(call_id(calls_of, first_index + i), FunctionCall(name, arguments))
        for i, (name, arguments) in enumerate(named)
    ]
