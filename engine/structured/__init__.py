"""Structured outputs: what a request asks its output to be (`StructuredOutput`), and the error
it gets when that cannot be served.

The request side is light on purpose (no grammar library is imported here): `SamplingParams`
carries a `StructuredOutput` across the engine channel, and only the engine compiles it
(`engine.structured.grammar`) and masks the logits with it (`engine.structured.mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loramux.engine.errors import InvalidRequestError

MAX_SCHEMA_CHARS = 100_000
"""Longest schema text accepted. OpenAI's own strict mode caps a schema far lower (5,000
properties, 15,000 characters of names and enum values); this bounds what one request can make
the compiler read."""


class StructuredOutputError(InvalidRequestError):
    """The requested structure cannot be served: the schema is not JSON, not an object, too
    large or deep, or the grammar library refused it. Raised at admission; nothing was queued."""


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain a request's output to JSON.

    - `json_object`: any JSON object (`json_schema` is None);
    - `json_schema`: a JSON value valid against `json_schema`, the schema as JSON text.

    Output is compact JSON (no whitespace between tokens of the syntax). The engine stops the
    request when the value is complete: the model's EOS is allowed only then, and is the only
    token allowed once nothing else can follow. Free-form strings and numbers in a schema are
    unbounded, so an output may still end at `max_tokens` (finish reason `length`) before its
    value is complete; `maxLength`, `maxItems`, `enum` and number bounds keep it short.
    """

    kind: Literal["json_object", "json_schema"]
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema"):
            raise StructuredOutputError(
                f"structured output kind must be 'json_object' or 'json_schema', got {self.kind!r}"
            )
        if self.kind == "json_object":
            if self.json_schema is not None:
                raise StructuredOutputError("a json_object structured output takes no schema")
            return
        if not isinstance(self.json_schema, str):
            raise StructuredOutputError("a json_schema structured output needs the schema text")
        if len(self.json_schema) > MAX_SCHEMA_CHARS:
            raise StructuredOutputError(
                f"the JSON schema is {len(self.json_schema)} characters long; "
                f"at most {MAX_SCHEMA_CHARS} are accepted"
            )

    @property
    def cache_key(self) -> tuple[str, str | None]:
        """What a compiled grammar is cached under: equal keys compile to the same grammar."""
        return (self.kind, self.json_schema)
