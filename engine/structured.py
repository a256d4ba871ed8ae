"""A constraint on what a request may generate (JSON mode, a JSON schema)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class StructuredOutput:
    kind: Literal["json_object", "json_schema"]
    json_schema: str | None = None
    """The schema as JSON text; None for json_object."""
