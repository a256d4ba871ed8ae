"""Request ids: the gateway names every request itself. A client's `x-request-id` is echoed
back for its tracing but keys nothing, so tenants that pick the same id never collide or learn
of each other; only plain short ids are echoed. The response's `id` always names the gateway's
id: a wrong cache hit is reported by it."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.tenants import TenantKey, new_tenant

TRACE = "trace-12345"


def chat(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def auth(tenant: TenantKey, request_id: str | bytes) -> dict[str, Any]:
    return {
        "authorization": f"Bearer {tenant.key}",
        "x-request-id": request_id,
        "cache-control": "no-store",
    }


def test_tenants_choosing_the_same_request_id_are_both_served(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    a, b = new_tenant(admin, "rid-a"), new_tenant(admin, "rid-b")
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json=chat(300, stream=True),
        headers=auth(a, TRACE),
        timeout=60,
    ) as held:
        assert held.status_code == 200
        data = (line for line in held.iter_lines() if line.startswith("data: "))
        a_id = json.loads(next(data)[6:])["id"]  # A's request is in flight
        r = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json=chat(4),
            headers=auth(b, TRACE),
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert held.headers["x-request-id"] == r.headers["x-request-id"] == TRACE
    b_id = r.json()["id"]
    assert a_id != b_id
    assert TRACE not in a_id and TRACE not in b_id
    assert a_id.startswith("chatcmpl-") and b_id.startswith("chatcmpl-")


def test_the_same_request_id_twice_from_one_tenant_is_served_twice(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    a = new_tenant(admin, "rid-same")
    first, second = (
        httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "demo-model", "prompt": "def f():", "max_tokens": 3},
            headers=auth(a, TRACE),
            timeout=60,
        )
        for _ in range(2)
    )
    assert first.status_code == second.status_code == 200
    assert first.json()["id"] != second.json()["id"]


@pytest.mark.parametrize(
    "given",
    ["x" * 65, "two words", "trace\xe9".encode("latin-1"), "<script>", "a;b,c", "tab\tid"],
    ids=["too-long", "space", "latin-1", "markup", "separators", "tab"],
)
def test_only_plain_short_request_ids_are_echoed(
    gateway: RunningServer, admin: httpx.Client, given: str | bytes
) -> None:
    a = new_tenant(admin, "rid-echo")
    r = httpx.get(f"{gateway.url}/v1/models", headers=auth(a, given))
    assert r.status_code == 200
    assert r.headers["x-request-id"].startswith("req_")
    plain = httpx.get(f"{gateway.url}/v1/models", headers=auth(a, "0af7651916cd43dd-8448eb211c80"))
    assert plain.headers["x-request-id"] == "0af7651916cd43dd-8448eb211c80"


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_a_hit_sent_with_the_clients_own_id_is_reported_by_its_response_id(
    gateway: RunningServer, admin: httpx.Client, route: str
) -> None:
    """The feedback endpoint took only the gateway's `req_…`, which a response whose client
    sent its own x-request-id (OpenAI's SDKs and tracing proxies do) carries nowhere: such a
    wrong hit could not be reported (404)."""
    tenant, other = new_tenant(admin, "rid-feedback"), new_tenant(admin, "rid-feedback")
    asked = f"Where is my invoice? {uuid.uuid4().hex}"
    chat = route == "chat/completions"
    prompt = {"messages": [{"role": "user", "content": asked}]} if chat else {"prompt": asked}
    body = {"model": "demo-model", "max_tokens": 4, "temperature": 0, **prompt}

    def ask(trace: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {tenant.key}", "x-request-id": trace}
        r = httpx.post(f"{gateway.url}/v1/{route}", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r

    ask("client-trace-1")
    hit = ask("client-trace-2")
    assert hit.headers["x-cache"] == "exact"
    assert hit.headers["x-request-id"] == "client-trace-2"

    def report(by: TenantKey, request_id: str) -> int:
        answer = {"tenant": by.tenant_id, "request_id": request_id}
        return admin.post("/admin/cache/feedback", json=answer).status_code

    assert report(tenant, "client-trace-2") == 404  # a client's id names nothing
    assert report(other, hit.json()["id"]) == 404  # another tenant's response
    assert report(tenant, hit.json()["id"]) == 200
    assert ask("client-trace-3").headers["x-cache"] == "miss"
