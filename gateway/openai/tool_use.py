"""Tool calling on the request path: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` mean for its generation (`gateway.openai.tools.tool_plan`), and each
choice's calls read out of its text, as it streams and whole.

Call ids derive from the response id and the choice index (`tools.call_id`), so a stream and a
whole response of the same request, and a cache hit replaying either, agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from loramux.gateway.openai.tools import (
    NO_TOOLS,
    ParsedToolCalls,
    ToolCallStreamParser,
    ToolPlan,
    parse_tool_calls,
)


@dataclass(frozen=True)
class ToolUse:
    plan: ToolPlan
    calls_of: str
    """The response id: with the choice index, what the call ids derive from."""

    def reader(self, index: int) -> ToolCallStreamParser | None:
        """A streaming reader of choice `index`'s calls; None when the output is plain content."""
        fmt = self.plan.output_format
        if fmt is None:
            return None
        return ToolCallStreamParser(fmt, self._calls_of(index), parallel=self.plan.parallel)

    def read(self, text: str, index: int) -> ParsedToolCalls | None:
        """Choice `index`'s whole text read as content and calls; None for plain content."""
        fmt = self.plan.output_format
        if fmt is None:
            return None
        return parse_tool_calls(text, fmt, self._calls_of(index), parallel=self.plan.parallel)

    def _calls_of(self, index: int) -> str:
        return f"{self.calls_of}#{index}"


NONE = ToolUse(NO_TOOLS, "")
