"""Malformed bodies, wrong types, oversize prompts and unsupported parameters get an
OpenAI-shaped 4xx with a request id — never a 500."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.server import RunningServer
from tests.gateway.tenants import TenantKey, new_tenant

OK = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tenant(gateway: RunningServer, admin_token: str) -> TenantKey:
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {admin_token}"}
    ) as admin:
        return new_tenant(admin, "badreq")


def _with(**changes: Any) -> bytes:
    body = dict(OK)
    for k, v in changes.items():
        if v is ...:
            body.pop(k)
        else:
            body[k] = v
    return json.dumps(body).encode()


CASES = {
    "not json": (b"{nope", 400),
    "empty body": (b"", 400),
    "json array": (b"[1, 2]", 400),
    "missing model": (_with(model=...), 400),
    "missing messages": (_with(messages=...), 400),
    "messages not a list": (_with(messages="hi"), 400),
    "empty messages": (_with(messages=[]), 400),
    "unknown role": (_with(messages=[{"role": "tool", "content": "x"}]), 400),
    "image content": (
        _with(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
    ),
    "temperature as string": (_with(temperature="hot"), 400),
    "temperature too high": (_with(temperature=3), 400),
    "max_tokens zero": (_with(max_tokens=0), 400),
    "max_tokens float": (_with(max_tokens=1.5), 400),
    "top_p out of range": (_with(top_p=2), 400),
    "n above one": (_with(n=3), 400),
    "tools": (_with(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    "logprobs": (_with(logprobs=True), 400),
    "json mode": (_with(response_format={"type": "json_object"}), 400),
    "five stops": (_with(stop=["a", "b", "c", "d", "e"]), 400),
    "stream not bool": (_with(stream="yes"), 400),
    "prompt over the context": (_with(messages=[{"role": "user", "content": "word " * 2000}]), 400),
    "body too large": (_with(messages=[{"role": "user", "content": "x" * (2 << 20)}]), 413),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_chat_request(gateway: RunningServer, tenant: TenantKey, case: str) -> None:
    body, status = CASES[case]
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=body,
        headers={"authorization": f"Bearer {tenant.key}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert r.headers["x-request-id"]


@pytest.mark.parametrize(
    "prompt",
    [[], [[1, 2], [3]], [1.5], [True], {"a": 1}, ["a", "b"]],
    ids=["empty", "two", "float", "bool", "obj", "2str"],
)
def test_bad_completion_prompt(gateway: RunningServer, tenant: TenantKey, prompt: Any) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": "demo-model", "prompt": prompt, "max_tokens": 2},
        headers={"authorization": f"Bearer {tenant.key}"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
