"""Every response shape of the OpenAI routes validates against OpenAI's published schema
(tests/fixtures/openai_openapi): chat completions whole and streamed (logprobs, several
choices, the usage chunk), text completions with their logprobs, models, and errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.openai.openapi_schemas import (
    CHAT,
    CHUNK,
    COMPLETION,
    ERROR,
    MODEL,
    MODELS,
    assert_valid,
)

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def sse_events(api: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[Any]:
    """The JSON events of a streamed response, up to `[DONE]` (which must come)."""
    with api.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                return
            yield json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended without data: [DONE]")


def test_a_chat_completion_with_logprobs_matches_openais_schema(oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model="demo-model",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    body = raw.http_response.json()
    assert_valid(CHAT, body)
    assert body["system_fingerprint"].startswith("fp_")
    parsed = raw.parse()  # the client reads it too
    assert parsed.choices[0].message.role == "assistant"


def test_every_chunk_of_a_chat_stream_matches_openais_schema(api: httpx.Client) -> None:
    body = {
        "model": "demo-model",
        "messages": MESSAGES,
        "max_tokens": 5,
        "temperature": 0.9,
        "seed": 3,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = list(sse_events(api, "/chat/completions", body))
    for chunk in chunks:
        assert_valid(CHUNK, chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert len({c["system_fingerprint"] for c in chunks}) == 1
    finishing = [c for ch in chunks for c in ch["choices"] if c["finish_reason"] is not None]
    assert sorted(c["index"] for c in finishing) == [0, 1]  # needs the engine's n choices
    logprobs = [c["logprobs"] for ch in chunks for c in ch["choices"] if c["logprobs"]]
    assert logprobs, "a chunk carries the logprobs of its tokens"  # needs the engine's logprobs


def test_a_text_completion_with_logprobs_matches_openais_schema(oai: openai.OpenAI) -> None:
    raw = oai.completions.with_raw_response.create(
        model="demo-model", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2
    )
    body = raw.http_response.json()
    assert_valid(COMPLETION, body)
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert raw.parse().choices[0].text == body["choices"][0]["text"]


def test_the_last_chunk_of_a_text_stream_matches_openais_schema(api: httpx.Client) -> None:
    """OpenAI's schema has no null finish_reason, which every chunk but the last one has (as
    OpenAI's own streams do): the last content chunk and the usage chunk are checked. The
    schema is a whole completion's, whose usage is never null; a stream chunk's is, with
    `include_usage` (`ChatCompletionStreamOptions`), so the content chunk is checked without it."""
    body = {
        "model": "demo-model",
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = list(sse_events(api, "/completions", body))
    *_, last, usage = chunks
    assert last.pop("usage") is None
    assert_valid(COMPLETION, last)
    assert_valid(COMPLETION, usage)
    assert last["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("path", "prompt"),
    [("/chat/completions", {"messages": MESSAGES}), ("/completions", {"prompt": "Once upon"})],
)
def test_with_include_usage_every_chunk_has_usage_null_but_the_last(
    api: httpx.Client, path: str, prompt: dict[str, Any]
) -> None:
    """OpenAI: with `include_usage`, `usage` "contains a null value except for the last
    chunk"; without it, no chunk has one. Asked twice, so the second may be a cache hit's
    replay."""
    body = {"model": "demo-model", **prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    for _ in range(2):
        *chunks, last = sse_events(api, path, {**body, "stream_options": {"include_usage": True}})
        assert chunks and all("usage" in c and c["usage"] is None for c in chunks), chunks
        assert last["choices"] == [] and last["usage"]["total_tokens"] > 0
        plain = list(sse_events(api, path, body))
        assert plain and all("usage" not in c for c in plain), plain


def test_models_and_one_model_match_openais_schema(oai: openai.OpenAI, api: httpx.Client) -> None:
    listed = api.get("/models").json()
    assert_valid(MODELS, listed)
    for model in listed["data"]:
        assert_valid(MODEL, api.get(f"/models/{model['id']}").json())
    assert oai.models.retrieve("demo-model").id == "demo-model"


def test_errors_match_openais_schema(api: httpx.Client) -> None:
    for r in (
        api.get("/models/no-such-model"),
        api.post("/chat/completions", json={"model": "demo-model", "messages": MESSAGES, "n": 0}),
        api.post("/chat/completions", json={"model": "no-such-model", "messages": MESSAGES}),
        api.post(
            "/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
    ):
        assert r.status_code in (400, 404), r.text
        assert_valid(ERROR, r.json())
