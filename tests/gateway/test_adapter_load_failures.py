"""An adapter the engine cannot load when a request needs it (its stored files changed or became
unreadable after the upload validated them): that request gets a 503 `adapter_unavailable`
saying so, counted in the gateway's metrics, and other tenants' requests are served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loramux.gateway.engine_client.local import LocalEngineClient
from loramux.gateway.metrics.routes import CHAT
from loramux.gateway.server import RunningServer
from tests.gateway.servers import gateway_server
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter
from tests.gateway.test_metrics import scrape, total


@pytest.fixture
def one_adapter_gateway(
    demo_model_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RunningServer]:
    """A gateway whose engine keeps one adapter in memory: the one uploaded last."""
    monkeypatch.setenv("LORAMUX_MAX_LORAS", "1")
    monkeypatch.setenv("LORAMUX_MAX_CPU_LORAS", "1")
    with gateway_server(demo_model_dir, tmp_path / "data", redis_url) as server:
        yield server


def chat(gw: RunningServer, tenant: TenantKey, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_an_adapter_that_cannot_be_loaded_is_a_503_for_its_request_alone(
    one_adapter_gateway: RunningServer, demo_adapter_dirs: list[Path]
) -> None:
    """Bug: the request got a 500 `request_failed`, as if the gateway had a bug, although the
    engine knew exactly what failed (`Readiness.FAILED`: the adapter's files)."""
    gw = one_adapter_gateway
    token = gw.state.admin.mint("test-admin", ttl_seconds=600)
    auth = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=gw.url, headers=auth, timeout=60) as admin:
        a, b = new_tenant(admin, "load-a"), new_tenant(admin, "load-b")
        digest = upload_adapter(admin, a.tenant_id, "fragile", demo_adapter_dirs[0])["digest"]
        upload_adapter(admin, b.tenant_id, "steady", demo_adapter_dirs[1])
    assert isinstance(gw.state.engine, LocalEngineClient)
    lora = gw.state.engine.engine.engine.lora
    assert lora is not None and digest not in lora.resident()  # it must be read from disk again
    stored = gw.state.store.get(digest)
    assert stored is not None
    weights = stored.path / "adapter_model.safetensors"
    weights.write_bytes(b"not safetensors any more" * 100)

    before, _ = scrape(gw)
    failed = chat(gw, a, "fragile")
    assert failed.status_code == 503, failed.text
    error = failed.json()["error"]
    assert error["code"] == "adapter_unavailable" and "could not be loaded" in error["message"]
    assert chat(gw, b, "steady").status_code == 200
    assert chat(gw, a, "demo-model").status_code == 200
    after, _ = scrape(gw)
    grew = total(after, "loramux_http_requests_total", route=CHAT, status="503") - total(
        before, "loramux_http_requests_total", route=CHAT, status="503"
    )
    assert grew == 1
