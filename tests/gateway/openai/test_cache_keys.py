"""The response cache keys on every parameter that changes the output: a request that differs
from a cached one only in such a parameter is not answered from the cache, and a hit replays
the original answer exactly, logprobs included."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

VARIANTS: dict[str, dict[str, Any]] = {
    "logit_bias": {"logit_bias": {"5": 3.0}},
    "n": {"n": 2},
    "response_format": {"response_format": {"type": "json_object"}},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.3},
}


def body(**extra: Any) -> dict[str, Any]:
    question = f"What is a lighthouse? ({uuid.uuid4().hex[:8]})"
    return {
        "model": "demo-model",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 6,
        "temperature": 0,
        **extra,
    }


@pytest.mark.parametrize("name", VARIANTS)
def test_a_request_differing_only_in_an_output_parameter_is_a_miss(
    api: httpx.Client, name: str
) -> None:
    base = body()
    assert api.post("/chat/completions", json=base).headers["x-cache"] == "miss"
    assert api.post("/chat/completions", json=base).headers["x-cache"] == "exact"
    variant = api.post("/chat/completions", json=base | VARIANTS[name])
    assert variant.status_code == 200, variant.text
    # n > 1 is never looked up (the cache keeps one choice), the others miss
    assert variant.headers["x-cache"] == ("bypass" if name == "n" else "miss")


def test_a_hit_replays_the_logprobs_exactly(api: httpx.Client) -> None:
    asked = body(logprobs=True, top_logprobs=3)
    first = api.post("/chat/completions", json=asked)
    hit = api.post("/chat/completions", json=asked)
    assert (first.headers["x-cache"], hit.headers["x-cache"]) == ("miss", "exact")
    assert hit.json()["choices"] == first.json()["choices"]
    assert hit.json()["system_fingerprint"] == first.json()["system_fingerprint"]
    streamed = []
    with api.stream("POST", "/chat/completions", json=asked | {"stream": True}) as r:
        assert r.headers["x-cache"] == "exact"
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    streamed += (choice["logprobs"] or {}).get("content") or []
    assert streamed == first.json()["choices"][0]["logprobs"]["content"]


def test_a_completion_hit_replays_its_logprobs(api: httpx.Client) -> None:
    asked = {"model": "demo-model", "prompt": uuid.uuid4().hex, "max_tokens": 5, "logprobs": 2}
    asked["temperature"] = 0
    first = api.post("/completions", json=asked)
    hit = api.post("/completions", json=asked)
    assert hit.headers["x-cache"] == "exact"
    assert hit.json()["choices"] == first.json()["choices"]


def reordered(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its properties listed the other way round (nothing else changed)."""
    return schema | {"properties": dict(reversed(schema["properties"].items()))}


ORDERED = {
    "type": "object",
    "properties": {"reasoning": {"enum": ["r"]}, "answer": {"enum": ["a"]}},
    "required": ["reasoning", "answer"],
    "additionalProperties": False,
}


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    }


def _tool(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "tools": [{"type": "function", "function": {"name": "answer", "parameters": schema}}],
        "tool_choice": {"type": "function", "function": {"name": "answer"}},
    }


@pytest.mark.parametrize("constraint", [_format, _tool])
def test_a_schema_differing_only_in_property_order_is_a_miss(
    api: httpx.Client, constraint: Any
) -> None:
    """The output's keys come in the schema's order, so a response_format or a forced tool's
    parameters listing the same properties in another order is another request. The bug: the
    key sorted the schema's keys, and the reordered request got the first one's answer."""
    base = body(max_tokens=40)
    first = api.post("/chat/completions", json=base | constraint(ORDERED))
    assert (first.status_code, first.headers["x-cache"]) == (200, "miss"), first.text
    again = api.post("/chat/completions", json=base | constraint(ORDERED))
    assert again.headers["x-cache"] == "exact"
    other = api.post("/chat/completions", json=base | constraint(reordered(ORDERED)))
    assert (other.status_code, other.headers["x-cache"]) == (200, "miss"), other.text
    assert other.json()["choices"][0] != first.json()["choices"][0]


def _history(arguments: dict[str, str]) -> list[dict[str, Any]]:
    """A conversation whose assistant turn called a tool with `arguments`, and its result."""
    call = {"name": "get_weather", "arguments": json.dumps(arguments)}
    return [
        {"role": "user", "content": f"Weather? ({uuid.uuid4().hex[:8]})"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


def test_a_history_call_differing_only_in_argument_order_is_a_miss(api: httpx.Client) -> None:
    """The chat template writes a history call's arguments in the client's key order (`tojson`
    does not sort), so two orders are two prompts. The bug: the key sorted them, and the second
    prompt was answered from the first one's entry."""
    first = _history({"k0": "", "city": "Paris", "unit": "c"})
    second = [*first[:1], *_history({"unit": "c", "city": "Paris", "k0": ""})[1:]]
    asked = body(max_tokens=12)
    stored = api.post("/chat/completions", json=asked | {"messages": first})
    assert (stored.status_code, stored.headers["x-cache"]) == (200, "miss"), stored.text
    again = api.post("/chat/completions", json=asked | {"messages": first})
    assert again.headers["x-cache"] == "exact"
    other = api.post("/chat/completions", json=asked | {"messages": second})
    assert (other.status_code, other.headers["x-cache"]) == (200, "miss"), other.text


def test_a_history_refusal_is_part_of_the_key(api: httpx.Client) -> None:
    """An assistant turn's `refusal` (content null) is that turn's text: the same history with
    an empty assistant turn is another prompt. The bug: the refusal was dropped, and that
    prompt was answered from the first one's entry."""
    asked = {"role": "user", "content": f"Tell me a secret. ({uuid.uuid4().hex[:8]})"}
    refused = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    follow_up = {"role": "user", "content": "Why not?"}
    first = body() | {"messages": [asked, refused, follow_up]}
    assert api.post("/chat/completions", json=first).headers["x-cache"] == "miss"
    assert api.post("/chat/completions", json=first).headers["x-cache"] == "exact"
    empty = first | {"messages": [asked, {"role": "assistant", "content": None}, follow_up]}
    other = api.post("/chat/completions", json=empty)
    assert (other.status_code, other.headers["x-cache"]) == (200, "miss"), other.text
