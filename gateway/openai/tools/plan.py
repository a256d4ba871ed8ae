"""What a request's `tools`, `tool_choice` and `parallel_tool_calls` mean for one generation:
the tools the chat template renders, how the output is read, and what constrains it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from loramux.gateway.errors import BadRequest
from loramux.gateway.openai.tools.forced import forced_call_schema
from loramux.gateway.openai.tools.formats import ToolCallFormat
from loramux.gateway.openai.tools.schemas import Tool, ToolChoice, checked_tools


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None
    """`tools=` for the chat template (OpenAI's tool objects as plain data); None without tools."""
    output_format: ToolCallFormat | None
    """How to read calls out of the output; None: the output is plain content."""
    forced_schema: str | None
    """The JSON schema generation is held to (StructuredOutput kind "json_schema"); None when
    nothing is forced."""
    parallel: bool
    """Whether more than one call may come back."""

    @property
    def reads_calls(self) -> bool:
        return self.output_format is not None


NO_TOOLS = ToolPlan(None, None, None, True)


def tool_plan(
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    model_format: ToolCallFormat | None,
) -> ToolPlan:
    """The plan for a request; raises BadRequest (naming the param) for tools OpenAI refuses,
    and for `auto` on a model whose chat template writes no tool calls (`model_format` None,
    from `tool_call_format`): its output could not be read."""
    tools, choice = checked_tools(tools, tool_choice)
    if not tools:
        return NO_TOOLS
    parallel = parallel_tool_calls is not False
    rendered = [msgspec.to_builtins(t) for t in tools]
    schema = forced_call_schema(tools, choice, parallel)
    if schema is not None:
        return ToolPlan(rendered, ToolCallFormat.JSON, schema, parallel)
    if choice == "none":
        return ToolPlan(rendered, None, None, parallel)
    if model_format is None:
        raise BadRequest(
            "this model's chat template does not support tools; use tool_choice 'required' or "
            "a named function, which constrain the output to a call",
            param="tools",
        )
    return ToolPlan(rendered, model_format, None, parallel)
