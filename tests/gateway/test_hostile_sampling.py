"""Hostile sampling numbers through the gateway: the caller gets a 400 naming the field, or an
ordinary answer (a vanishing temperature samples greedily), and the next request of another
tenant is served. The gateway here is one of its own, so an engine such a request stopped
would harm no other test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.servers import gateway_server
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter


@pytest.fixture(scope="module")
def own_gateway(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[RunningServer]:
    with gateway_server(demo_model_dir, tmp_path_factory.mktemp("hostile"), redis_url) as gw:
        yield gw


@pytest.fixture(scope="module")
def tenants(own_gateway: RunningServer) -> tuple[TenantKey, TenantKey]:
    token = own_gateway.state.admin.mint("test-admin", ttl_seconds=600)
    auth = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=own_gateway.url, headers=auth, timeout=60) as admin:
        return new_tenant(admin, "hostile-a"), new_tenant(admin, "hostile-b")


def chat(gw: RunningServer, tenant: TenantKey, **sampling: Any) -> httpx.Response:
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "Name three sorting algorithms."}],
        "max_tokens": 12,
    } | sampling
    headers = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


HOSTILE = {
    "temperature 1e-38": {"temperature": 1e-38},
    "temperature 5e-324": {"temperature": 5e-324},
    "top_p 1e-300": {"temperature": 1.0, "top_p": 1e-300},
    "seed 2**64+5": {"temperature": 1.0, "seed": 2**64 + 5},
    "seed -2**63": {"temperature": 1.0, "seed": -(2**63)},
    "seed 2**63-1, top_k 2**31-1": {"temperature": 2.0, "seed": 2**63 - 1, "top_k": 2**31 - 1},
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_sampling_request_never_stops_another_tenants_request(
    own_gateway: RunningServer, tenants: tuple[TenantKey, TenantKey], case: str
) -> None:
    a, b = tenants
    sampling = HOSTILE[case]
    hostile = chat(own_gateway, a, **sampling)
    assert hostile.status_code in (200, 400), hostile.text
    if hostile.status_code == 400:
        assert hostile.json()["error"]["param"] in sampling
    elif sampling["temperature"] < 1e-30:
        assert text(hostile) == text(chat(own_gateway, a, temperature=0))
    after = chat(own_gateway, b, temperature=0)
    assert after.status_code == 200, after.text


def test_an_adapter_that_overflows_fails_its_own_request_alone(
    own_gateway: RunningServer, tenants: tuple[TenantKey, TenantKey], overflowing_adapter: Path
) -> None:
    """A tenant's adapter whose weights overflow float32 yields non-finite logits: that request
    gets a 500 `request_failed` (the engine's fault, not the request's), and the engine keeps
    serving the other tenant."""
    a, b = tenants
    token = own_gateway.state.admin.mint("test-admin", ttl_seconds=600)
    with httpx.Client(
        base_url=own_gateway.url, headers={"authorization": f"Bearer {token}"}, timeout=60
    ) as admin:
        upload_adapter(admin, a.tenant_id, "overflowing", overflowing_adapter)
    failed = chat(own_gateway, a, model="overflowing", temperature=0)
    assert failed.status_code == 500, failed.text
    assert failed.json()["error"]["code"] == "request_failed"
    after = chat(own_gateway, b, temperature=0)
    assert after.status_code == 200, after.text
