"""Tool calling for the OpenAI chat API: request and response shapes, the plan a request's tool
fields make, reading calls out of each model family's output (whole or streamed), the schema
that forces a call, and tool turns of the history as chat templates take them."""

from loramux.gateway.openai.tools.forced import forced_call_schema, parse_forced_output
from loramux.gateway.openai.tools.formats import (
    ParsedToolCalls,
    ToolCallFormat,
    call_id,
    tool_call_format,
)
from loramux.gateway.openai.tools.plan import NO_TOOLS, ToolPlan, tool_plan
from loramux.gateway.openai.tools.schemas import (
    FunctionCall,
    FunctionCallDelta,
    FunctionDefinition,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    checked_tools,
)
from loramux.gateway.openai.tools.stream import StreamDelta, ToolCallStreamParser, parse_tool_calls
from loramux.gateway.openai.tools.turns import template_tool_calls, template_tool_result

__all__ = [
    "NO_TOOLS",
    "FunctionCall",
    "FunctionCallDelta",
    "FunctionDefinition",
    "NamedToolChoice",
    "ParsedToolCalls",
    "StreamDelta",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallStreamParser",
    "ToolChoice",
    "ToolPlan",
    "call_id",
    "checked_tools",
    "forced_call_schema",
    "parse_forced_output",
    "parse_tool_calls",
    "template_tool_calls",
    "template_tool_result",
    "tool_call_format",
    "tool_plan",
]
