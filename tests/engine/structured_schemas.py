"""JSON schemas the structured-output tests and benchmark generate against: each bounds its
strings, arrays and numbers, so the grammar itself forces the value to close."""

from __future__ import annotations

import json
from typing import Any


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


NESTED = _object(
    {
        "user": _object(
            {
                "name": {"type": "string", "maxLength": 8},
                "address": _object(
                    {
                        "city": {"type": "string", "maxLength": 8},
                        "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                    },
                    ["city", "zip"],
                ),
            },
            ["name", "address"],
        )
    },
    ["user"],
)
ARRAYS = _object(
    {
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 1,
            "maxItems": 4,
        },
        "labels": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    ["scores", "labels"],
)
ENUMS = _object(
    {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        "flag": {"enum": [True, None, 3]},
    },
    ["color", "size", "flag"],
)
NUMBERS = _object(
    {
        "count": {"type": "integer", "minimum": -10, "maximum": 10},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125},
        "offset": {"type": "integer", "exclusiveMinimum": -50, "exclusiveMaximum": 50},
    },
    ["count", "ratio", "offset"],
)
OPTIONAL = _object(
    {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "nickname": {"type": "string", "maxLength": 6},
        "active": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    ["id"],
)
RECURSIVE = {
    "$defs": {
        "node": _object(
            {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            ["v"],
        )
    },
    "$ref": "#/$defs/node",
}

FAILS_MID_RUN = _object(
    {
        "a": {"enum": ["x", "y"]},
        "b": {"type": "array", "items": {"const": 1}, "minItems": 100_000},
    },
    ["a", "b"],
)
"""Compiles, and its first token is accepted; once `a` is chosen, the grammar forces 100,000
items, more text in a row than the engine serves (engine.structured.grammar.MAX_FORCED_BYTES)
and past the parser's item limit: the request's own schema fails it mid-generation."""

FORCES_MID_RUN = {"anyOf": [{"const": "a" + " " * 20_000}, {"const": "b" + " " * 20_000}]}
"""Forces only `"` at first; once `a` or `b` is chosen, 20,000 spaces: past the engine's bound
on forced text (engine.structured.grammar.MAX_FORCED_BYTES), so the request fails there."""

DEAD_END = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
"""Compiles, and its first mask and token are fine; once `{"a":` is forced, the value of `a`
(a reference to itself) has no way forward: computing that mask fails the grammar
(NoExtensionBias), and the failed mask allows only EOS."""

FAILING_MID_RUN = {"bytes of output in a row": FAILS_MID_RUN, "NoExtensionBias": DEAD_END}
"""Schemas whose grammar fails mid-generation, by the reason the library gives."""

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": NESTED,
    "arrays": ARRAYS,
    "enums": ENUMS,
    "numbers": NUMBERS,
    "optional": OPTIONAL,
}


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema)
