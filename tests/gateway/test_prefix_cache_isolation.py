"""The prefix cache never carries one tenant's prompts to another: a tenant sending a prompt
another tenant sent sees `cached_tokens: 0` (on the base model and on shared adapters), while
its own repeats are reused. Tenants an operator puts in the shared scope reuse each other's
prompts. Nothing in another tenant's responses mentions the first tenant's activity."""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.conftest import json_of
from tests.gateway.tenants import TenantKey, new_key, new_tenant, upload_adapter

SHARED_ADAPTER = "prefix-iso-shared"


@pytest.fixture(scope="module")
def shared_adapter(gateway: RunningServer, admin_token: str, demo_adapter_dirs: list[Path]) -> str:
    auth = {"authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=gateway.url, headers=auth, timeout=120) as admin:
        upload_adapter(admin, "shared", SHARED_ADAPTER, demo_adapter_dirs[3])
    return SHARED_ADAPTER


def long_prompt() -> str:
    """A prompt of well over 50 tokens that no earlier request began with."""
    words = "the scheduler admits waiting sequences while free blocks remain in the pool"
    return f"{uuid.uuid4().hex} " + " ".join([words] * 6)


def ask(
    gw: RunningServer, tenant: TenantKey, content: str, model: str, **extra: Any
) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
    } | extra
    headers = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


def prompt_tokens_computed(gw: RunningServer) -> int:
    """Prompt tokens the engine has run through the model since it started."""
    [stats] = gw.run(gw.state.engine.stats())
    return stats.prompt_tokens_computed


def cached(r: httpx.Response) -> int:
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 50
    return int(usage["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("on", ["base", "shared adapter"])
def test_another_tenants_prompt_is_never_reused(
    gateway: RunningServer, admin: httpx.Client, shared_adapter: str, on: str
) -> None:
    model = "demo-model" if on == "base" else shared_adapter
    a, b, c, d = (new_tenant(admin, f"prefix-{n}") for n in "abcd")
    prompt = long_prompt()
    first = ask(gateway, a, prompt, model)
    assert cached(first) == 0
    assert cached(ask(gateway, a, prompt, model)) >= 48, "a tenant reuses its own prompt"
    _, a_other_key = new_key(admin, a.tenant_id)
    assert cached(ask(gateway, replace(a, key=a_other_key), prompt, model)) >= 48

    computed_before = prompt_tokens_computed(gateway)
    seen_by_b = ask(gateway, b, prompt, model)
    assert cached(seen_by_b) == 0
    # B's request computes its whole prompt, as for a prompt nobody sent: the same work and so
    # the same latency, whatever A sent.
    computed = prompt_tokens_computed(gateway) - computed_before
    assert computed == seen_by_b.json()["usage"]["prompt_tokens"]
    assert cached(ask(gateway, c, prompt, model, max_tokens=3, temperature=0.7, seed=1)) == 0
    assert cached(ask(gateway, d, prompt.rsplit(" ", 1)[0] + " queue", model)) == 0
    traces = seen_by_b.text + str(seen_by_b.headers)
    assert a.tenant_id not in traces and first.json()["id"] not in traces


def test_tenants_in_the_shared_scope_reuse_each_others_prompts(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    r = admin.post(
        "/admin/tenants",
        json={"name": f"prefix-s1-{uuid.uuid4().hex[:8]}", "prefix_cache_scope": "shared"},
    )
    assert r.status_code == 201, r.text
    assert json_of(r)["prefix_cache_scope"] == "shared"
    s1 = TenantKey(r.json()["id"], r.json()["name"], *new_key(admin, r.json()["id"]))
    s2, private = new_tenant(admin, "prefix-s2"), new_tenant(admin, "prefix-private")
    r = admin.patch(f"/admin/tenants/{s2.tenant_id}", json={"prefix_cache_scope": "shared"})
    assert r.status_code == 200 and json_of(r)["prefix_cache_scope"] == "shared"

    prompt = long_prompt()
    assert cached(ask(gateway, s1, prompt, "demo-model")) == 0
    assert cached(ask(gateway, s2, prompt, "demo-model")) >= 48
    assert cached(ask(gateway, private, prompt, "demo-model")) == 0

    r = admin.patch(f"/admin/tenants/{s2.tenant_id}", json={"prefix_cache_scope": "tenant"})
    assert json_of(r)["prefix_cache_scope"] == "tenant"
    assert cached(ask(gateway, s2, long_prompt(), "demo-model")) == 0


@pytest.mark.parametrize("scope", ["public", "", None, 1, ["shared"]])
def test_the_prefix_cache_scope_is_validated(admin: httpx.Client, scope: Any) -> None:
    tenant = new_tenant(admin, "prefix-bad")
    r = admin.patch(f"/admin/tenants/{tenant.tenant_id}", json={"prefix_cache_scope": scope})
    assert r.status_code == 400, r.text
    assert "prefix_cache_scope" in r.json()["error"]["message"]
    r = admin.post(
        "/admin/tenants",
        json={"name": f"prefix-{uuid.uuid4().hex[:8]}", "prefix_cache_scope": scope},
    )
    assert r.status_code == 400, r.text
    assert json_of(admin.get(f"/admin/tenants/{tenant.tenant_id}"))["prefix_cache_scope"] == (
        "tenant"
    )
