"""Hostile sampling parameters are refused with a 400 naming the parameter, before anything is
tokenized or queued: logit_bias with too many entries, keys that are not token ids, values out
of range; logprobs counts out of range; response formats that are malformed or nest too deep;
tool turns that are not what they claim. Valid ones of each kind are served."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from loramux.engine.outputs import EngineStats
from loramux.gateway.openai.prompt import chat_messages
from loramux.gateway.openai.schemas import ChatMessage
from loramux.gateway.server import RunningServer

MESSAGES = [{"role": "user", "content": "hi"}]


def raw(**fields: str) -> bytes:
    """A chat body with `fields` set to JSON literals json.dumps cannot write."""
    base = json.dumps({"model": "demo-model", "messages": MESSAGES, "max_tokens": 2})
    return (base[:-1] + "".join(f', "{k}": {v}' for k, v in fields.items()) + "}").encode()


def bias(entries: dict[str, Any]) -> str:
    return json.dumps(entries)


REFUSED: dict[str, tuple[bytes, str]] = {
    "logit_bias with 301 entries": (
        raw(logit_bias=bias({str(i): 1 for i in range(301)})),
        "logit_bias",
    ),
    "logit_bias key not a number": (raw(logit_bias=bias({"abc": 1})), "logit_bias"),
    "logit_bias key negative": (raw(logit_bias=bias({"-1": 1})), "logit_bias"),
    "logit_bias key a float": (raw(logit_bias=bias({"1.5": 1})), "logit_bias"),
    "logit_bias key past 64 bits": (raw(logit_bias=bias({str(2**70): 1})), "logit_bias"),
    "logit_bias key in fullwidth digits": (raw(logit_bias=bias({"１２": 1})), "logit_bias"),
    "logit_bias key past the vocabulary": (raw(logit_bias=bias({"10000000": 1})), "logit_bias"),
    "logit_bias value above 100": (raw(logit_bias=bias({"5": 101})), "logit_bias"),
    "logit_bias keys aliasing one token": (
        raw(logit_bias=bias({"7".zfill(width): 100 for width in range(1, 11)})),
        "logit_bias",
    ),
    "logit_bias key with a leading zero": (raw(logit_bias=bias({"07": 1})), "logit_bias"),
    "logit_bias value 1e400": (raw(logit_bias='{"5": 1e400}'), "logit_bias"),
    "logit_bias value NaN": (raw(logit_bias='{"5": NaN}'), ""),
    "logit_bias not an object": (raw(logit_bias="[1, 2]"), "logit_bias"),
    "top_logprobs 21": (raw(logprobs="true", top_logprobs="21"), "top_logprobs"),
    "top_logprobs without logprobs": (raw(top_logprobs="2"), "top_logprobs"),
    "logprobs a number": (raw(logprobs="3"), "logprobs"),
    "n a billion": (raw(n=str(10**9)), "n"),
    "n 2^70": (raw(n=str(2**70)), "n"),
    "unknown response format": (raw(response_format='{"type": "xml"}'), "response_format"),
    "json_schema bad name": (
        raw(response_format='{"type": "json_schema", "json_schema": {"name": "a b"}}'),
        "response_format",
    ),
    "json_schema nested past the body limit": (
        raw(
            response_format='{"type": "json_schema", "json_schema": {"name": "x", "schema": '
            + '{"a": ' * 40
            + "1"
            + "}" * 40
            + "}}"
        ),
        "",
    ),
    "tool call arguments not an object": (
        raw(
            messages=json.dumps(
                [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    }
                ]
            )
        ),
        "messages[0].tool_calls[0].function.arguments",
    ),
    "tool calls on a user message": (
        raw(
            messages=json.dumps(
                [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            )
        ),
        "messages[0].tool_calls",
    ),
    "tool_choice without tools": (raw(tool_choice='"required"'), "tool_choice"),
}


def stats(gateway: RunningServer) -> EngineStats:
    [s] = gateway.run(gateway.state.engine.stats())
    return s


@pytest.mark.parametrize("case", REFUSED)
def test_a_hostile_parameter_is_refused_naming_it_and_nothing_is_queued(
    gateway: RunningServer, api: httpx.Client, case: str
) -> None:
    content, param = REFUSED[case]
    before = stats(gateway)
    r = api.post("/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param:
        assert (error["param"] or "").startswith(param), error
    after = stats(gateway)
    assert after.prompt_tokens_computed == before.prompt_tokens_computed
    assert after.waiting == after.running == 0


def test_logit_bias_keys_aliasing_one_token_are_refused_on_completions_too(
    api: httpx.Client,
) -> None:
    """ "7" and "07" name one token: taken both, their biases would add up past [-100, 100]
    (or cancel out)."""
    for aliases in ({"7": 100, "07": 100}, {"7": 100, "0000000007": -100}):
        body = {"model": "demo-model", "prompt": "hi", "max_tokens": 1, "logit_bias": aliases}
        r = api.post("/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "logit_bias"
    body = {"model": "demo-model", "prompt": "hi", "max_tokens": 1, "logit_bias": {"0": 1}}
    assert api.post("/completions", json=body).status_code == 200, "0 is written canonically"


def test_a_million_logit_bias_entries_are_refused_unread(api: httpx.Client) -> None:
    entries = ",".join(f'"{i}":1' for i in range(10**6))
    r = api.post(
        "/chat/completions",
        content=raw(logit_bias="{" + entries + "}"),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413, r.text


@pytest.mark.parametrize(
    "extra",
    [
        {"logit_bias": {"5": -100, "6": 100}},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 1.5, "min_p": 0.1},
        {"logprobs": True, "top_logprobs": 20},
        {"logprobs": False, "top_logprobs": 0},
        {"response_format": {"type": "text"}},
        {"response_format": {"type": "json_object"}},
        {"n": 16, "max_tokens": 1},
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ]
        },
    ],
    ids=[
        "logit_bias",
        "penalties",
        "extensions",
        "top_logprobs",
        "no_logprobs",
        "text",
        "json",
        "n16",
        "tool_turns",
    ],
)
def test_valid_parameters_are_served(api: httpx.Client, extra: dict[str, Any]) -> None:
    body = {"model": "demo-model", "messages": MESSAGES, "max_tokens": 2} | extra
    r = api.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == extra.get("n", 1)


def test_stream_null_is_a_whole_response(api: httpx.Client, oai: openai.OpenAI) -> None:
    """OpenAI's schema has `stream` nullable and its SDK sends `"stream": null` for
    `stream=None`: both routes take it as false. The bug: a 400 for a bool that was null."""
    out = oai.chat.completions.create(
        model="demo-model",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=2,
        stream=None,
    )
    assert out.choices[0].message.role == "assistant"
    body = {"model": "demo-model", "prompt": "hi", "max_tokens": 2, "stream": None}
    r = api.post("/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


@pytest.mark.parametrize(
    ("path", "prompt"),
    [("/chat/completions", {"messages": MESSAGES}), ("/completions", {"prompt": "hi"})],
)
@pytest.mark.parametrize("stream", [False, None, ...], ids=["false", "null", "absent"])
def test_stream_options_without_a_stream_is_refused_as_openai_refuses_it(
    api: httpx.Client, path: str, prompt: dict[str, Any], stream: object
) -> None:
    """OpenAI answers 400 (param `stream_options`) when `stream` is not true: the client that
    asked for a usage chunk is told it gets none. `stream_options: null` is no option at all.
    The bug: a 200 that silently dropped `include_usage`."""
    body: dict[str, Any] = {"model": "demo-model", "max_tokens": 2} | prompt
    if stream is not ...:
        body["stream"] = stream
    r = api.post(path, json=body | {"stream_options": {"include_usage": True}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "stream_options")
    assert "only allowed when 'stream' is enabled" in error["message"]
    r = api.post(path, json=body | {"stream_options": None})
    assert r.status_code == 200, r.text


UNSERVED: dict[str, tuple[str, dict[str, Any], str]] = {
    "audio output": (
        "chat",
        {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
        "modalities",
    ),
    "audio parameters": ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    "web search": (
        "chat",
        {"web_search_options": {"search_context_size": "high"}},
        "web_search_options",
    ),
    "predicted output": (
        "chat",
        {"prediction": {"type": "content", "content": "hi"}},
        "prediction",
    ),
    "functions": ("chat", {"functions": [{"name": "f"}]}, "functions"),
    "echo": ("text", {"echo": True}, "echo"),
    "suffix": ("text", {"suffix": "end"}, "suffix"),
    "best_of": ("text", {"best_of": 2}, "best_of"),
}


@pytest.mark.parametrize("case", UNSERVED)
def test_an_openai_field_that_would_change_the_output_is_refused_naming_it(
    api: httpx.Client, case: str
) -> None:
    """A field OpenAI serves and loramux does not is a 400 naming it, never ignored: the client
    would miss its `message.audio`, or take an answer as searched. The bugs: audio output and web
    search were answered with 200, without either."""
    kind, field, param = UNSERVED[case]
    if kind == "chat":
        r = api.post(
            "/chat/completions", json={"model": "demo-model", "messages": MESSAGES} | field
        )
    else:
        r = api.post("/completions", json={"model": "demo-model", "prompt": "hi"} | field)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_name_reaches_a_template_that_writes_it() -> None:
    """A template that writes names (`PromptTokens.named_roles`) gets each message's `name`;
    in a role it writes none for, the message is served without it (clients such as multi-agent
    frameworks send names on every message; OpenAI-compatible servers take them). The bug: the
    name was dropped before every template, those that write names included."""
    alice = ChatMessage(role="user", content="Who am I?", name="Alice")
    bob = ChatMessage(role="assistant", content="Hi", name="Bob")
    messages = chat_messages([alice, bob], named_roles=frozenset({"user"}))
    assert messages == [
        {"role": "user", "content": "Who am I?", "name": "Alice"},
        {"role": "assistant", "content": "Hi"},
    ]


def test_a_speakers_name_is_served_by_a_template_that_writes_none(api: httpx.Client) -> None:
    """The demo's ChatML, like Llama 3's and Qwen's templates, writes no name: a named message
    is answered (200), as by OpenAI-compatible servers, not refused."""
    named = [{"role": "user", "name": "Alice", "content": "Who am I?"}]
    r = api.post("/chat/completions", json={"model": "demo-model", "messages": named})
    assert r.status_code == 200, r.text


REFUSED_ANSWER = "I can't help with that request."


def _prompt_tokens(api: httpx.Client, messages: list[dict[str, Any]]) -> int:
    body = {"model": "demo-model", "messages": messages, "max_tokens": 1, "temperature": 0}
    r = api.post("/chat/completions", json=body, headers={"cache-control": "no-store"})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def test_an_assistant_refusal_in_the_history_is_that_turns_text(api: httpx.Client) -> None:
    """OpenAI hands a refused answer back as `content: null, refusal: "..."`; sent back in the
    history, the refusal is what the assistant said. The bug: it was dropped unseen, and the
    model read an empty assistant turn."""

    def history(turn: dict[str, Any]) -> list[dict[str, Any]]:
        asked = {"role": "user", "content": "Tell me a secret."}
        return [asked, {"role": "assistant"} | turn, {"role": "user", "content": "Why not?"}]

    refused = _prompt_tokens(api, history({"content": None, "refusal": REFUSED_ANSWER}))
    assert refused == _prompt_tokens(api, history({"content": REFUSED_ANSWER}))
    assert refused > _prompt_tokens(api, history({"content": None}))


@pytest.mark.parametrize(
    "turn",
    [
        {"role": "assistant", "content": "Sure.", "refusal": REFUSED_ANSWER},
        {"role": "user", "content": None, "refusal": REFUSED_ANSWER},
    ],
    ids=["beside content", "not the assistant's"],
)
def test_a_refusal_the_template_could_not_take_is_refused_naming_it(
    api: httpx.Client, turn: dict[str, Any]
) -> None:
    messages = [{"role": "user", "content": "hi"}, turn]
    body = {"model": "demo-model", "messages": messages, "max_tokens": 1}
    r = api.post("/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].refusal", r.text


def test_openai_fields_that_leave_the_output_alone_are_served(api: httpx.Client) -> None:
    """Fields about OpenAI's own service (storage, tiers, metadata, reasoning models) and text as
    the one output modality change nothing here, and are taken (docs/architecture.md lists them)."""
    harmless = {
        "modalities": ["text"],
        "audio": None,
        "store": True,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "reasoning_effort": "low",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
    }
    body = {"model": "demo-model", "messages": MESSAGES, "max_tokens": 2} | harmless
    r = api.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
