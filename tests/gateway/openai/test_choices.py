"""n choices through the gateway: one engine request whose outputs are told apart by choice
index, reserved against quotas as n × max_tokens and billed for what the choices generated;
a stop string ends only the choice it matched in."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from loramux.gateway.server import RunningServer
from tests.gateway.tenants import TenantKey, new_tenant

MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
NO_CACHE = {"cache-control": "no-store"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "messages": MESSAGES, "temperature": 1.0, "seed": 7, **extra}


def post(gateway: RunningServer, tenant: TenantKey, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {tenant.key}", **NO_CACHE},
        timeout=60,
    )


def limited(admin: httpx.Client, tpm: int) -> TenantKey:
    """A new tenant whose key may use `tpm` tokens a minute."""
    tenant = new_tenant(admin, "choices")
    r = admin.put(f"/admin/keys/{tenant.key_id}/quotas", json={"tpm": tpm})
    assert r.status_code == 200, r.text
    return tenant


def test_n_choices_reserve_n_times_max_tokens_and_settle_what_they_generated(
    gateway: RunningServer, admin_module: httpx.Client
) -> None:
    tenant = limited(admin_module, 100_000)
    first = post(gateway, tenant, chat(n=4, max_tokens=8))
    assert first.status_code == 200, first.text
    body = first.json()
    prompt = body["usage"]["prompt_tokens"]
    # admitted with 4 × max_tokens reserved
    assert first.headers["x-ratelimit-remaining-tokens"] == str(100_000 - prompt - 4 * 8)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == prompt  # the prompt counts once
    used = body["usage"]["total_tokens"]
    second = post(gateway, tenant, chat(max_tokens=3))
    # the first request now counts for what it used; the second for its reservation
    assert second.headers["x-ratelimit-remaining-tokens"] == str(100_000 - used - prompt - 3)


def test_a_reservation_of_n_times_max_tokens_over_the_limit_is_refused(
    gateway: RunningServer, admin_module: httpx.Client
) -> None:
    tenant = limited(admin_module, 200)
    refused = post(gateway, tenant, chat(n=4, max_tokens=50))
    assert refused.status_code == 429, refused.text
    assert post(gateway, tenant, chat(n=1, max_tokens=50)).status_code == 200


def test_n_choices_through_the_openai_client(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="demo-model",
        messages=MESSAGES,  # type: ignore[arg-type]
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=11,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1  # seeded choices differ
    generated = sum(len(c.message.content or "") > 0 for c in out.choices)
    assert generated == 3 and out.usage is not None and out.usage.completion_tokens >= 3


def test_a_streamed_request_for_two_choices_reassembles_to_the_whole_one(
    api: httpx.Client,
) -> None:
    body = chat(n=2, max_tokens=12)
    whole = api.post("/chat/completions", json=body, headers=NO_CACHE).json()
    texts = ["", ""]
    finish: dict[int, str] = {}
    with api.stream("POST", "/chat/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}


def test_a_stop_string_ends_only_the_choice_it_matched_in(api: httpx.Client) -> None:
    """The choices are sampled; each is cut before the first stop string it wrote, and those
    that never wrote one run to max_tokens."""
    unstopped = api.post("/chat/completions", json=chat(n=4, max_tokens=24), headers=NO_CACHE)
    texts = [c["message"]["content"] for c in unstopped.json()["choices"]]
    stop = next(ch for ch in texts[0][2:] if not ch.isspace())  # a character choice 0 writes
    stopped = api.post(
        "/chat/completions", json=chat(n=4, max_tokens=24, stop=[stop]), headers=NO_CACHE
    )
    for before, after in zip(texts, stopped.json()["choices"], strict=True):
        if stop in before:
            assert after["message"]["content"] == before[: before.index(stop)]
            assert after["finish_reason"] == "stop"
        else:
            assert after["message"]["content"] == before
