"""logprobs through the gateway and the official client: chat's per-token entries (token text,
UTF-8 bytes, logprob, top alternatives) whole and streamed, and the legacy completions format.
The values themselves are the engine's (tests/engine); here, that the API carries them."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
import pytest

from loramux.engine.demo_model import IM_END_ID

MESSAGES = [{"role": "user", "content": "Describe the sea in one sentence."}]


def test_chat_logprobs_through_the_openai_client(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="demo-model",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = choice.logprobs.content
    # every generated token is billed; the end of turn is no token of the content
    ended_turn = choice.finish_reason == "stop"
    assert out.usage is not None and len(entries) + ended_turn == out.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0.0 and entry.bytes is not None
        assert len(entry.top_logprobs) == 5
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True)
        # greedy: the chosen token is the most likely one
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, top[0])
    text = bytes(b for e in entries for b in e.bytes or []).decode()
    assert text == choice.message.content


def test_streamed_chat_logprobs_equal_the_whole_responses(api: httpx.Client) -> None:
    body = {
        "model": "demo-model",
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    headers = {"cache-control": "no-store"}
    whole = api.post("/chat/completions", json=body, headers=headers).json()
    streamed = []
    with api.stream(
        "POST", "/chat/completions", json=body | {"stream": True}, headers=headers
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    streamed += (choice["logprobs"] or {}).get("content") or []
    assert streamed == whole["choices"][0]["logprobs"]["content"]


def _chat_logprobs(api: httpx.Client, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    """A chat choice's content, logprobs entries, finish reason and the response's cache
    outcome and completion tokens, whole or gathered from its stream."""
    if not body.get("stream"):
        r = api.post("/chat/completions", json=body, headers=headers)
        choice = r.json()["choices"][0]
        return {
            "content": choice["message"]["content"],
            "entries": choice["logprobs"]["content"],
            "finish": choice["finish_reason"],
            "x-cache": r.headers["x-cache"],
            "completion_tokens": r.json()["usage"]["completion_tokens"],
        }
    out: dict[str, Any] = {"content": "", "entries": []}
    with api.stream("POST", "/chat/completions", json=body, headers=headers) as r:
        out["x-cache"] = r.headers["x-cache"]
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            out["completion_tokens"] = (chunk["usage"] or {}).get("completion_tokens")
            for choice in chunk["choices"]:
                out["content"] += choice["delta"].get("content") or ""
                out["entries"] += (choice["logprobs"] or {}).get("content") or []
                out["finish"] = choice["finish_reason"] or out.get("finish")
    return out


def test_chat_logprobs_leave_out_the_end_of_turn_the_content_does_not_show(
    api: httpx.Client,
) -> None:
    """OpenAI's chat logprobs list the content's tokens: their bytes joined are the content.
    Whole, streamed, and replayed from the cache. The bug: a choice that ended at the end of
    turn listed `<|im_end|>` too, whose bytes the content does not hold. The token is still
    billed as generated."""
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": f"Say nothing. ({uuid.uuid4().hex[:8]})"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": {str(IM_END_ID): 100},  # the turn ends at once
    }
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    answers = [
        _chat_logprobs(api, body),
        _chat_logprobs(api, body),
        _chat_logprobs(api, streamed, **{"cache-control": "no-store"}),
        _chat_logprobs(api, streamed),
    ]
    assert [a["x-cache"] for a in answers] == ["miss", "exact", "bypass", "exact"]
    for answer in answers:
        assert (answer["finish"], answer["completion_tokens"]) == ("stop", 1), answer
        joined = b"".join(bytes(e["bytes"]) for e in answer["entries"])
        assert joined.decode() == answer["content"] == "", answer


def test_completion_logprobs_in_the_legacy_format(oai: openai.OpenAI) -> None:
    out = oai.completions.create(
        model="demo-model", prompt="The sea is", max_tokens=8, temperature=0, logprobs=3
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.text_offset
    assert lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    if choice.finish_reason == "length":
        assert "".join(lp.tokens) == choice.text


LEGACY = {"model": "demo-model", "prompt": "Once upon", "max_tokens": 12, "temperature": 0}


def _legacy(api: httpx.Client, stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A legacy completion's one choice with `logprobs: 0`, whole or gathered from its stream."""
    body = LEGACY | {"logprobs": 0, "stream": stream} | extra
    headers = {"cache-control": "no-store"}
    if not stream:
        return dict(api.post("/completions", json=body, headers=headers).json()["choices"][0])
    text, tokens, offsets = "", [], []
    with api.stream("POST", "/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    text += choice["text"]
                    tokens += (choice["logprobs"] or {}).get("tokens") or []
                    offsets += (choice["logprobs"] or {}).get("text_offset") or []
    return {"text": text, "logprobs": {"tokens": tokens, "text_offset": offsets}}


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_count_every_earlier_tokens_text_whatever_the_stop_strings(
    api: httpx.Client, stream: bool
) -> None:
    """A token's `text_offset` is the length of the text of the tokens before it: a stop string
    that never matches moves none, and the token that completes one starts where the tokens
    before it end. The bug: offsets counted the text released so far, which lags behind while
    a tail that could begin a stop string is held back."""
    plain = _legacy(api, stream)
    tokens = plain["logprobs"]["tokens"]
    text = "".join(tokens)
    assert text == plain["text"] and "\ufffd" not in text, tokens
    assert plain["logprobs"]["text_offset"] == [len("".join(tokens[:i])) for i in range(12)]
    never = list({t[-1] + "\u0007\u0007" for t in tokens[:-1] if t})[:4]
    unmatched = _legacy(api, stream, stop=never)
    assert unmatched == plain
    # two characters across a token boundary, first found there
    stop = next(
        stop
        for k in range(2, len(tokens))
        if text.find(stop := tokens[k - 1][-1] + tokens[k][0]) == len("".join(tokens[:k])) - 1
    )
    stopped = _legacy(api, stream, stop=[stop])["logprobs"]
    assert stopped["tokens"] == tokens[: len(stopped["tokens"])]
    assert stopped["text_offset"] == plain["logprobs"]["text_offset"][: len(stopped["tokens"])]


@pytest.mark.parametrize("k", [0, 1])
def test_legacy_top_logprobs_always_hold_the_sampled_token(api: httpx.Client, k: int) -> None:
    """OpenAI: "The API will always return the logprob of the sampled token, so there may be up
    to logprobs+1 elements": with `logprobs: 0` each entry holds the sampled token alone. The bug:
    entries listed the k most likely only, so a sampled token outside them was missing."""
    body = LEGACY | {"max_tokens": 16, "temperature": 2.0, "seed": 11, "logprobs": k}
    lp = api.post("/completions", json=body, headers={"cache-control": "no-store"}).json()
    lp = lp["choices"][0]["logprobs"]
    entries = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    for token, logprob, top in entries:
        assert top[token] == logprob and 1 <= len(top) <= k + 1, (token, logprob, top)
    if k == 0:
        assert all(len(top) == 1 for top in lp["top_logprobs"])
    else:  # sampled at a high temperature: not always the most likely
        assert any(len(top) == 2 for top in lp["top_logprobs"]), lp


def test_no_logprobs_unless_asked(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="demo-model",
        messages=MESSAGES,
        max_tokens=3,  # type: ignore[arg-type]
    )
    assert out.choices[0].logprobs is None


LEAD_BYTES = {"161": 100, "162": 100, "175": 100}
"""Demo tokenizer ids of the lone UTF-8 lead bytes 0xE2, 0xE3 and 0xF0, made the most likely."""


def test_tokens_that_split_a_character_are_named_by_their_bytes_in_both_apis(
    api: httpx.Client,
) -> None:
    """A token whose bytes are no whole UTF-8 text is named as OpenAI does, `bytes:\\xe2`, in
    chat and legacy logprobs alike: distinct tokens keep distinct legacy `top_logprobs` keys.
    The bug: all three read U+FFFD, one key, and the sampled token's logprob overwrote it."""
    names = {"bytes:\\xe2", "bytes:\\xe3", "bytes:\\xf0"}
    body = {"model": "demo-model", "max_tokens": 1, "temperature": 0, "logit_bias": LEAD_BYTES}
    headers = {"cache-control": "no-store"}
    legacy = body | {"prompt": "hello", "logprobs": 3}
    lp = api.post("/completions", json=legacy, headers=headers).json()["choices"][0]["logprobs"]
    assert set(lp["top_logprobs"][0]) == names and lp["tokens"][0] in names, lp
    assert lp["top_logprobs"][0][lp["tokens"][0]] == lp["token_logprobs"][0]

    chat = body | {"messages": MESSAGES, "logprobs": True, "top_logprobs": 3}
    [entry] = api.post("/chat/completions", json=chat, headers=headers).json()["choices"][0][
        "logprobs"
    ]["content"]
    assert {(t["token"], *t["bytes"]) for t in entry["top_logprobs"]} == {
        ("bytes:\\xe2", 0xE2),
        ("bytes:\\xe3", 0xE3),
        ("bytes:\\xf0", 0xF0),
    }
    assert entry["token"] in names
