"""OpenAI's published response schemas (tests/fixtures/openai_openapi), as validators.

The fixture was cut from openai-openapi's `openapi.json` with:

    roots = [the six response schemas]; closure = roots + every `#/components/schemas/X` they
    reference, transitively; write {"components": {"schemas": {name: spec[name] for closure}}}

Some of its schemas use OpenAPI 3.0's `nullable: true`, which JSON Schema ignores: it is read
here as "or null", as OpenAI's own SDKs read it.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

FIXTURE = Path(__file__).parents[2] / "fixtures" / "openai_openapi" / "schemas.json"

CHAT = "CreateChatCompletionResponse"
CHUNK = "CreateChatCompletionStreamResponse"
COMPLETION = "CreateCompletionResponse"
MODEL = "Model"
MODELS = "ListModelsResponse"
ERROR = "ErrorResponse"


def _with_nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_with_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _with_nullable(v) for k, v in node.items()}
    if out.pop("nullable", False):
        if "$ref" in out:  # a nullable reference: the referenced schema, or null
            return {"anyOf": [out, {"type": "null"}]}
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


@cache
def _components() -> dict[str, Any]:
    components: dict[str, Any] = _with_nullable(json.loads(FIXTURE.read_text())["components"])
    return components


@cache
def validator(name: str) -> Draft202012Validator:
    schema = {"components": _components(), "$ref": f"#/components/schemas/{name}"}
    return Draft202012Validator(schema)


def assert_valid(name: str, instance: Any) -> None:
    """Fails with every violation of OpenAI's schema `name`."""
    errors = [
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in validator(name).iter_errors(instance)
    ]
    assert not errors, f"not a valid {name}:\n" + "\n".join(errors)
