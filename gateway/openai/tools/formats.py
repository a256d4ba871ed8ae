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
    them, separated by whitespace or `;`. None unless all of `body` is such calls (at least one)."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    at = _skip_separators(body, 0)
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return None
        for item in value if isinstance(value, list) else [value]:
            call = _call(item)
            if call is None:
                return None
            calls.append(call)
        at = _skip_separators(body, at)
    return calls or None


_SEPARATORS = re.compile(r"[\s;]*")


def _skip_separators(text: str, at: int) -> int:
    match = _SEPARATORS.match(text, at)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _call(item: Any) -> tuple[str, str] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    text = arguments_text(arguments)
    return None if text is None else (item["name"], text)


def arguments_text(arguments: dict[str, Any]) -> str | None:
    """The arguments as JSON text; None where they cannot be written (nested past the encoder's
    stack). Non-ASCII stays as it is, unless a lone surrogate (from a `\\ud800` escape) is in
    it: then everything is ASCII-escaped, still valid JSON of the same value, and UTF-8-safe."""
    try:
        text = json.dumps(arguments, ensure_ascii=False)
        text.encode("utf-8")
    except RecursionError:
        return None
    except UnicodeEncodeError:
        return json.dumps(arguments)
    return text


def tool_calls(named: list[tuple[str, str]], calls_of: str, first_index: int) -> list[ToolCall]:
    """ToolCall structs for decoded calls, numbered from `first_index` within their choice."""
    return [
        ToolCall(call_id(calls_of, first_index + i), FunctionCall(name, arguments))
        for i, (name, arguments) in enumerate(named)
    ]
