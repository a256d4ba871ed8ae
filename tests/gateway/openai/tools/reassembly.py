"""What an OpenAI client builds from a streamed response's tool-call deltas."""

from __future__ import annotations

from loramux.gateway.openai.tools import (
    FunctionCall,
    ParsedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
)


def reassemble(deltas: list[StreamDelta]) -> ParsedToolCalls:
    """What an OpenAI client builds from a stream: content appended, and per call index the id,
    type and name of its first delta and the arguments of all its deltas joined."""
    content = ""
    by_index: dict[int, list[ToolCallDelta]] = {}
    for delta in deltas:
        if isinstance(delta, str):
            content += delta
        else:
            by_index.setdefault(delta.index, []).append(delta)
    calls = []
    for index in sorted(by_index):
        first, *rest = by_index[index]
        assert first.id is not None and first.type == "function"
        assert first.function.name is not None and first.function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in rest)
        arguments = "".join(d.function.arguments or "" for d in rest)
        calls.append(ToolCall(first.id, FunctionCall(first.function.name, arguments)))
    assert sorted(by_index) == list(range(len(by_index)))
    return ParsedToolCalls(None if calls and not content else content, calls)
