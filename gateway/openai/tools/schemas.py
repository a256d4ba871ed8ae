"""The wire shapes of tool calling, as OpenAI has them: the `tools` a request offers, its
`tool_choice`, and the calls an assistant turn made (in a request's history or a response)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema object of the function's arguments."""
    strict: bool | None = None


class ToolSpec(msgspec.Struct, forbid_unknown_fields=True):
    """One tool a request offers the model."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: FunctionChoice


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str
    """The arguments as JSON text (as the model wrote them)."""


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """A call an assistant turn made."""

    id: str
    type: Literal["function"]
    function: FunctionCall
