"""Realistic outputs of each model family when it calls tools (and when it does not), written
after the formats their chat templates teach: Qwen2.5-Instruct / Hermes 2 Pro
(`<tool_call>` tags, one JSON object each), Llama 3.1/3.2-Instruct (JSON with "parameters",
optionally after `<|python_tag|>`), Mistral-7B-Instruct-v0.3 (`[TOOL_CALLS]` then a JSON array)."""

from __future__ import annotations

from loramux.gateway.openai.tools import ToolCallFormat

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"zone": "Europe/Paris"}'

HERMES_SAMPLES = [
    # One call, no text.
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>",
    # Two calls, newline between, trailing newline.
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n'
    "</tool_call>\n",
    # Text, then a call.
    "Let me check the weather for you.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    # Junk inside the tags, then a good call.
    "<tool_call>\n{name: get_weather}\n</tool_call>\n"
    '<tool_call>{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}</tool_call>',
    # No call; text mentioning tags by halves.
    "Plain answer with a < sign, a <tool and a <tool_cal at the end <tool_c",
    # A call cut short by max_tokens.
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    # An unclosed but complete call at the end of the output.
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n',
    # Unicode in text and arguments.
    'Voilà — <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}</tool_call> ✓',
]

LLAMA3_SAMPLES = [
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    '<|python_tag|>{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
    "  \n" + '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
    "The weather in Paris is sunny.",
    '{"not": "a call"}',
    '{"name": "get_weather", "parameters": {"city": "Par',
]

MISTRAL_SAMPLES = [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
    # The marker is a special token: a detokenizer that skips those leaves the bare array.
    '[{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
    'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
    "[1, 2, 3] are the first numbers.",
    "No tools needed [TOOL",
]

JSON_SAMPLES = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
    '[{"name": "get_weather", "arguments": {"ci',
]

SAMPLES = {
    ToolCallFormat.HERMES: HERMES_SAMPLES,
    ToolCallFormat.LLAMA3_JSON: LLAMA3_SAMPLES,
    ToolCallFormat.MISTRAL: MISTRAL_SAMPLES,
    ToolCallFormat.JSON: JSON_SAMPLES,
}
