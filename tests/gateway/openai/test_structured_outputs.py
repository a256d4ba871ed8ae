"""Structured outputs through the gateway and the official client: with `response_format`
json_schema (strict) every output of the random-weight demo model parses and validates, at
temperature 1.0, while unconstrained requests and several adapters share its batches; a schema
the grammar library cannot compile is a 400 on `response_format`, streamed or not, and nothing
is queued."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from loramux.engine.outputs import EngineStats
from loramux.gateway.server import RunningServer
from tests.engine.structured_schemas import FAILING_MID_RUN, SCHEMAS
from tests.gateway.openai.openapi_schemas import CHAT, COMPLETION, assert_valid
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter
from tests.gateway.test_billing import usage_events

CONSTRAINED = 50
FREE = 10


@pytest.fixture(scope="module")
def adapters(
    admin_module: httpx.Client, tenant: TenantKey, demo_adapter_dirs: list[Path]
) -> list[str]:
    """Two of the tenant's own adapters, uploaded from folders no other test uses."""
    for i, folder in enumerate(demo_adapter_dirs[30:32]):
        upload_adapter(admin_module, tenant.tenant_id, f"structured-{i}", folder)
    return ["structured-0", "structured-1"]


def strict(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def stats(gateway: RunningServer) -> EngineStats:
    [s] = gateway.run(gateway.state.engine.stats())
    return s


async def _ask(client: openai.AsyncOpenAI, i: int, models: list[str]) -> tuple[Any, Any]:
    names = list(SCHEMAS)
    name = names[i % len(names)]
    constrained = i < CONSTRAINED
    extra: dict[str, Any] = {"response_format": strict(name, SCHEMAS[name])} if constrained else {}
    reply = await client.chat.completions.create(
        model=models[i % len(models)],
        messages=[{"role": "user", "content": f"Describe record {i} as JSON."}],
        temperature=1.0,
        seed=i,
        max_tokens=200,
        extra_headers={"cache-control": "no-store"},
        **extra,
    )
    return (SCHEMAS[name] if constrained else None), reply


def test_strict_json_schema_outputs_validate_mixed_with_free_requests_and_adapters(
    gateway: RunningServer, tenant: TenantKey, adapters: list[str]
) -> None:
    models = ["demo-model", *adapters]

    async def run() -> list[tuple[Any, Any]]:
        client = openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key=tenant.key, max_retries=0, timeout=300
        )
        try:
            return await asyncio.gather(
                *(_ask(client, i, models) for i in range(CONSTRAINED + FREE))
            )
        finally:
            await client.close()

    results = gateway.run(run())
    assert len(results) == CONSTRAINED + FREE
    for schema, reply in results:
        choice = reply.choices[0]
        if schema is None:
            continue
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert {reply.model for _, reply in results} == set(models)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "("},
        {"$ref": "#/$defs/missing"},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"not": {"type": "string"}},
    ],
)
def test_an_uncompilable_schema_is_a_400_and_nothing_is_queued(
    gateway: RunningServer, api: httpx.Client, schema: dict[str, Any], stream: bool
) -> None:
    before = stats(gateway)
    r = api.post(
        "/chat/completions",
        json={
            "model": "demo-model",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": strict("bad", schema),
            "stream": stream,
        },
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert "cannot be compiled" in error["message"]
    after = stats(gateway)
    assert (after.waiting, after.running, after.steps) == (
        before.waiting,
        before.running,
        before.steps,
    )


ENUM = {"enum": ["ab", "cd"]}


def constrained(
    api: httpx.Client, schema: dict[str, Any], path: str = "/chat/completions", **body: Any
) -> Any:
    """The 200 response's body of a request for `schema`'s output, with `body`'s parameters
    (a chat request unless `path` says otherwise)."""
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if path == "/chat/completions"
        else {"prompt": "hi"}
    )
    r = api.post(
        path,
        json={"model": "demo-model", "response_format": strict("s", schema), **prompt, **body},
        headers={"cache-control": "no-store"},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_top_logprobs_of_a_constrained_output_list_only_tokens_the_grammar_allows(
    api: httpx.Client,
) -> None:
    """Logprobs of a constrained output are of the masked distribution the token was drawn
    from: every number is finite, and the alternatives are only tokens the grammar allowed
    (each continues the text so far towards one of the enum's values), so fewer than asked.
    The bug: masked tokens (logprob -inf) filled the top list and were sent as
    `"logprob": null`, which OpenAI's schema refuses."""
    body = constrained(api, ENUM, logprobs=True, top_logprobs=5, temperature=0, max_tokens=20)
    assert_valid(CHAT, body)
    choice = body["choices"][0]
    assert json.loads(choice["message"]["content"]) in ENUM["enum"]
    values = [json.dumps(v) for v in ENUM["enum"]]
    text = ""
    for entry in choice["logprobs"]["content"]:
        assert entry["top_logprobs"], entry
        for top in entry["top_logprobs"]:
            assert math.isfinite(top["logprob"]), entry
            # Until the value is complete; then only EOS tokens are allowed.
            assert text in values or any(v.startswith(text + top["token"]) for v in values)
        text += entry["token"]


def test_legacy_completion_top_logprobs_of_a_constrained_output_are_numbers(
    api: httpx.Client,
) -> None:
    """The legacy format's top logprobs (a map from text to number) hold only the tokens the
    grammar allowed, each with a finite logprob. The bug: masked tokens were listed as null."""
    body = constrained(api, ENUM, "/completions", logprobs=5, temperature=0, max_tokens=20)
    assert_valid(COMPLETION, body)
    tops = body["choices"][0]["logprobs"]["top_logprobs"]
    assert tops and all(top and all(math.isfinite(v) for v in top.values()) for top in tops)


def test_every_choice_of_a_constrained_request_answers(api: httpx.Client) -> None:
    """With `n` > 1 each choice of a `response_format` request follows its own grammar: all
    three validate. The bug: the forked choices were masked by the wrong rows, and the request
    failed with 500 request_failed."""
    schema = SCHEMAS["enums"]
    body = constrained(api, schema, n=3, temperature=1.0, seed=2, max_tokens=200)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), schema)


def test_a_literal_holding_control_token_text_is_answered_as_text(api: httpx.Client) -> None:
    """A `const` holding the text of the chat template's own control token is generated as
    that text (user text never becomes a control token). The bug: the grammar library turned
    the text into the control token and the request failed with 500 request_failed."""
    choice = constrained(api, {"const": "<|im_end|>"}, max_tokens=20)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ('"<|im_end|>"', "stop")


def test_the_output_keeps_the_schemas_property_order(api: httpx.Client) -> None:
    """Keys come in the order the schema lists its properties, as OpenAI's do (a `reasoning`
    placed first is generated before `answer`). The bug: the gateway sorted the schema's keys,
    so `answer` came first."""
    schema = {
        "type": "object",
        "properties": {"reasoning": {"enum": ["r"]}, "answer": {"enum": ["a"]}},
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }
    choice = constrained(api, schema, temperature=0, max_tokens=60)["choices"][0]
    assert list(json.loads(choice["message"]["content"])) == ["reasoning", "answer"], choice


FORCED_RUNS = {
    "items": {"type": "array", "items": {"const": 1}, "minItems": 100_000},
    "const": {"const": " " * 99_000},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("forced", FORCED_RUNS)
def test_a_schema_that_forces_a_long_run_is_a_400(
    api: httpx.Client, stream: bool, forced: str
) -> None:
    """A grammar forcing more than 4,096 bytes in a row from its start is refused at admission
    (a stream too: its response starts with its first output), with the reason. The bugs:
    100,000 forced items were admitted and failed on the step thread with a 500
    `request_failed` (the server's fault); a 99,000-space `const` passed the gateway's check
    and was served, each of its masks tokenizing all the rest of the run again (0.2-0.4 s, for
    every row, every step), and every other tenant's request waited for those steps."""
    schema = FORCED_RUNS[forced]
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"response_format": strict("many", schema), "max_tokens": 10, "stream": stream}
    r = api.post("/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_format")
    assert "bytes of output in a row" in error["message"]
    assert "at most 4,096 are served" in error["message"]


@pytest.mark.parametrize("reason", FAILING_MID_RUN)
def test_a_schema_that_fails_mid_generation_is_the_clients_error_billed_and_not_cached(
    gateway: RunningServer, admin_module: httpx.Client, reason: str
) -> None:
    """A grammar that fails after a few tokens (past the library's limits, or with no way
    forward): only the request's own schema can do that, so it is a 400 invalid_request_error
    naming the structured output, not a 500 `request_failed`; it is billed for its prompt and
    the tokens generated, and nothing is stored in the response cache: asked again, it fails
    again. The bug (no way forward): the failed grammar's mask allowed only EOS, and the client
    got a 200 with finish_reason `stop` and the cut `{"a":`, which the cache then served."""
    tenant = new_tenant(admin_module, "mid-run")
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"response_format": strict("mid", FAILING_MID_RUN[reason]), "max_tokens": 20}
    body |= {"temperature": 0}  # cacheable
    headers = {"authorization": f"Bearer {tenant.key}"}
    with httpx.Client(base_url=f"{gateway.url}/v1", headers=headers, timeout=60) as api:
        for _ in range(2):
            r = api.post("/chat/completions", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            code = ("invalid_request_error", "structured_output_failed")
            assert (error["type"], error["code"]) == code
            assert reason in error["message"]
    events = usage_events(gateway, tenant, 2)
    assert [e.status for e in events] == [400, 400]
    assert all(e.prompt_tokens > 0 and e.completion_tokens > 0 for e in events), events
