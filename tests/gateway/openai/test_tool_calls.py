"""Tool calling through the gateway and the official client: a forced call (`required` or a
named function) comes back as `tool_calls` whose arguments validate against the function's
parameters, streamed as tool-call deltas that reassemble to the whole response, and replayed
exactly by the response cache; tools and tool turns reach the chat template."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from loramux.gateway.server import RunningServer
from tests.engine.structured_schemas import DEAD_END
from tests.gateway.openai.openapi_schemas import CHAT, CHUNK, assert_valid
from tests.gateway.openai.tools.tool_adapter import MESSAGES as ADAPTER_MESSAGES
from tests.gateway.openai.tools.tool_adapter import TOOLS as ADAPTER_TOOLS
from tests.gateway.openai.tools.tool_adapter import build_tool_calling_adapter
from tests.gateway.tenants import TenantKey, upload_adapter
from tests.gateway.test_metrics import scrape, total

SUCCESS = "loramux_request_success_total"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def ask(**extra: Any) -> dict[str, Any]:
    question = f"What is the weather in Oslo? ({uuid.uuid4().hex[:6]})"
    return {
        "model": "demo-model",
        "messages": [{"role": "user", "content": question}],
        "tools": [WEATHER],
        "max_tokens": 60,
        "temperature": 0,
        **extra,
    }


def test_a_named_tool_choice_returns_a_call_whose_arguments_validate(oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(**ask(tool_choice=NAMED))
    body = raw.http_response.json()
    assert_valid(CHAT, body)
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[arg-type]


PYDANTIC_STYLE = {
    "type": "function",
    "function": {
        "name": "locate",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "integer", "minimum": 0, "maximum": 9},
                "twin": {"$ref": "#/properties/name"},
                "place": {"$ref": "#/$defs/Place"},
            },
            "required": ["name", "twin", "place"],
            "additionalProperties": False,
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                }
            },
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "locate"}}, "required"]
)
def test_a_forced_call_of_parameters_with_references_is_served(
    api: httpx.Client, tool_choice: Any
) -> None:
    """Parameters as Pydantic writes them (`$defs` and "#/$defs/..."), and a reference to a
    property of their own: the forced call's arguments validate against them. The bug: the
    references resolved against the call's schema around the parameters, so "#/$defs/Place" was
    refused (400) and "#/properties/name" meant the call's `name` (the function's name)."""
    body = ask(tool_choice=tool_choice, parallel_tool_calls=False)
    body |= {"tools": [PYDANTIC_STYLE], "max_tokens": 80}
    r = api.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert_valid(CHAT, r.json())
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, PYDANTIC_STYLE["function"]["parameters"])  # type: ignore[index]


NOT_OBJECTS = {
    "enum": {"enum": [1, 2]},
    "anyOf": {"anyOf": [{"type": "integer"}]},
    "ref": {"$ref": "#/$defs/N", "$defs": {"N": {"type": "integer"}}},
}
"""Parameters with no `type` that allow no object."""


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "pick"}}, "required"]
)
@pytest.mark.parametrize("parameters", NOT_OBJECTS.values(), ids=NOT_OBJECTS)
def test_a_forced_call_of_parameters_that_allow_no_object_is_a_400(
    api: httpx.Client, parameters: dict[str, Any], tool_choice: Any
) -> None:
    """Arguments are always an object, so such a function cannot be called: the request is
    refused on `tools`. The bug: the parameters constrained the output as they were (a bare
    `1`), and the forced call came back as content with finish_reason `stop`."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": parameters}}
    r = api.post("/chat/completions", json=ask(tools=[tool], tool_choice=tool_choice))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("tools"), r.text


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_a_forced_call_whose_grammar_fails_mid_generation_is_a_400(
    api: httpx.Client, tool_choice: Any
) -> None:
    """Parameters whose grammar reaches a dead end once `{"a":` is written: the call cannot be
    completed, so the request fails with the structured output's 400. The bug: the failed
    grammar allowed only EOS, and the cut call came back as content, finish_reason `stop`."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": DEAD_END}}
    r = api.post("/chat/completions", json=ask(tools=[tool], tool_choice=tool_choice))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "structured_output_failed", r.text


def test_a_forced_call_of_untyped_parameters_is_a_call_with_object_arguments(
    api: httpx.Client,
) -> None:
    """Parameters without a `type` that do allow an object (here, through a `$ref`) are held
    to one: the forced call is a call whose arguments validate."""
    parameters = {
        "$ref": "#/$defs/P",
        "$defs": {
            "P": {
                "properties": {"n": {"enum": [1, 2]}},
                "required": ["n"],
                "additionalProperties": False,
            }
        },
    }
    tool = {"type": "function", "function": {"name": "pick", "parameters": parameters}}
    named = {"type": "function", "function": {"name": "pick"}}
    r = api.post("/chat/completions", json=ask(tools=[tool], tool_choice=named))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments, dict)
    jsonschema.validate(arguments, parameters)


def streamed_calls(api: httpx.Client, body: dict[str, Any]) -> tuple[str | None, list[Any]]:
    """The finish reason and the calls of `body`'s request streamed, reassembled from the
    tool-call deltas (each chunk checked against OpenAI's schema)."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    with api.stream(
        "POST",
        "/chat/completions",
        json=body | {"stream": True},
        headers={"cache-control": "no-store"},
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert_valid(CHUNK, chunk)
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
                for delta in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(
                        delta["index"], {"type": "function", "function": {"arguments": ""}}
                    )
                    call["id"] = delta.get("id", call.get("id"))
                    function = delta.get("function") or {}
                    if "name" in function:
                        call["function"]["name"] = function["name"]
                    call["function"]["arguments"] += function.get("arguments") or ""
    return finish, [calls[i] for i in sorted(calls)]


def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(api: httpx.Client) -> None:
    # One call: a list of parallel calls has no bound the random-weight model must reach.
    body = ask(tool_choice="required", parallel_tool_calls=False)
    whole = api.post("/chat/completions", json=body, headers={"cache-control": "no-store"})
    finish, calls = streamed_calls(api, body)
    expected = whole.json()["choices"][0]
    assert finish == expected["finish_reason"] == "tool_calls"
    # call ids derive from the response id: the same calls, under this response's ids
    assert all(c["id"].startswith("call_") for c in calls)
    assert [c["function"] for c in calls] == [
        c["function"] for c in expected["message"]["tool_calls"]
    ]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def test_arguments_are_the_numbers_the_model_wrote_whole_and_streamed(
    api: httpx.Client, demo_model_dir: Path
) -> None:
    """The grammar allows any JSON number, and logit_bias steers the demo model to write a
    huge one (`9999e9999...`, valid JSON). The arguments are the model's text, the same whole
    and streamed. The bug: the gateway read them with `json.loads` (a float, inf) and wrote
    them again with `json.dumps`, so the client got `{"x": Infinity}`, which is not JSON."""
    vocab = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    bias = {str(vocab.token_to_id(t)): b for t, b in (("9999", 50), ("e", 100), ("}", 60))}
    parameters = {
        "type": "object",
        "properties": {"x": {"type": "number"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    named = {"type": "function", "function": {"name": "f"}}
    body = ask(tools=[tool], tool_choice=named, logit_bias=bias)
    whole = api.post("/chat/completions", json=body, headers={"cache-control": "no-store"})
    assert whole.status_code == 200, whole.text
    assert_valid(CHAT, whole.json())
    [choice] = whole.json()["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    arguments = call["function"]["arguments"]
    assert json.loads(arguments, parse_constant=_refuse_constant).keys() == {"x"}
    assert "e" in arguments, arguments  # the bias did steer it to an exponent
    finish, streamed = streamed_calls(api, body)
    assert finish == "tool_calls"
    assert [c["function"] for c in streamed] == [call["function"]]


def test_a_cache_hit_replays_the_tool_calls_exactly(
    api: httpx.Client, gateway: RunningServer
) -> None:
    """And both count as the finish reason their clients got, `tool_calls`: the engine's answer
    was counted as `stop` and the hit as `tool_calls` (found by attacking the metrics)."""
    body = ask(tool_choice=NAMED)
    before, _ = scrape(gateway)
    first = api.post("/chat/completions", json=body)
    hit = api.post("/chat/completions", json=body)
    after, _ = scrape(gateway)
    assert (first.headers["x-cache"], hit.headers["x-cache"]) == ("miss", "exact")
    assert hit.json()["choices"] == first.json()["choices"]
    assert hit.json()["choices"][0]["message"]["tool_calls"]
    assert first.json()["choices"][0]["finish_reason"] == "tool_calls"
    counted = {
        reason: total(after, SUCCESS, finished_reason=reason)
        - total(before, SUCCESS, finished_reason=reason)
        for reason in ("stop", "length", "tool_calls")
    }
    assert counted == {"stop": 0, "length": 0, "tool_calls": 2}


def test_tools_reach_the_template_and_tool_turns_are_served(api: httpx.Client) -> None:
    plain = api.post("/chat/completions", json=ask(tool_choice="none") | {"tools": None})
    offered = api.post("/chat/completions", json=ask(tool_choice="none"))
    assert plain.status_code == offered.status_code == 200, offered.text
    assert offered.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Oslo", "unit": "c"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]
    answered = api.post("/chat/completions", json=ask(messages=history))
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["prompt_tokens"] > offered.json()["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def tool_model(
    admin_module: httpx.Client,
    tenant: TenantKey,
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """The tenant's adapter taught to call get_weather (tests.gateway.openai.tools)."""
    folder = build_tool_calling_adapter(demo_model_dir, tmp_path_factory.mktemp("tool-adapter"))
    upload_adapter(admin_module, tenant.tenant_id, "weather-caller", folder)
    return "weather-caller"


@pytest.mark.slow
def test_auto_reads_the_adapters_call_whole_streamed_and_from_the_cache(
    oai: openai.OpenAI, api: httpx.Client, tool_model: str
) -> None:
    body = {
        "model": tool_model,
        "messages": ADAPTER_MESSAGES,
        "tools": ADAPTER_TOOLS,
        "max_tokens": 64,
        "temperature": 0,
    }
    raw = oai.chat.completions.with_raw_response.create(**body)
    assert_valid(CHAT, raw.http_response.json())
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    whole = raw.http_response.json()["choices"][0]
    calls: dict[int, dict[str, Any]] = {}
    with api.stream(
        "POST",
        "/chat/completions",
        json=body | {"stream": True},
        headers={"cache-control": "no-store"},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                assert_valid(CHUNK, chunk)
                for c in chunk["choices"]:
                    for delta in c["delta"].get("tool_calls") or []:
                        got = calls.setdefault(delta["index"], {"arguments": ""})
                        got |= {k: delta[k] for k in ("id", "type") if k in delta}
                        got["name"] = delta["function"].get("name", got.get("name"))
                        got["arguments"] += delta["function"].get("arguments") or ""
    # another response, so other call ids (they derive from the response id); the same calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls.values())
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls.values()] == [
        c["function"] for c in whole["message"]["tool_calls"]
    ]
    hit = api.post("/chat/completions", json=body)
    assert hit.headers["x-cache"] == "exact"
    assert hit.json()["choices"][0] == whole


def test_a_forced_call_the_engines_probe_refuses_is_a_400_naming_tools(api: httpx.Client) -> None:
    """Bug: the engine's compile probe refuses this forced call's schema (it forces more text
    in a row than the engine serves; the gateway's own check, with no tokenizer, passes it),
    and the 400 named `response_format`, which the request does not have."""
    parameters = {
        "type": "object",
        "properties": {"b": {"type": "array", "items": {"const": 1}, "minItems": 100_000}},
        "required": ["b"],
        "additionalProperties": False,
    }
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "max_tokens": 10,
    }
    whole = api.post("/chat/completions", json=body)
    assert whole.status_code == 400, whole.text
    streamed = api.post("/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 400, streamed.text  # refused before its first output
    errors = [whole.json()["error"], streamed.json()["error"]]
    refused = [(e["param"], "bytes of output in a row" in e["message"]) for e in errors]
    assert refused == [("tools", True)] * 2
