"""Nothing one tenant does reaches another tenant's adapters or keys; dead keys fail."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.tenants import TenantKey, new_key, new_tenant, upload_adapter


@pytest.fixture(scope="module")
def admin_m(gateway: RunningServer, admin_token: str) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {admin_token}"}, timeout=120
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tenants(admin_m: httpx.Client, demo_adapter_dirs: list[Path]) -> tuple[TenantKey, TenantKey]:
    a, b = new_tenant(admin_m, "iso-a"), new_tenant(admin_m, "iso-b")
    upload_adapter(admin_m, a.tenant_id, "secret-sauce", demo_adapter_dirs[1])
    upload_adapter(admin_m, "shared", "iso-common", demo_adapter_dirs[2])
    return a, b


def _chat(gateway: RunningServer, key: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def _models(gateway: RunningServer, key: str) -> list[str]:
    r = httpx.get(f"{gateway.url}/v1/models", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def test_private_adapter_is_invisible_to_other_tenants(
    gateway: RunningServer, tenants: tuple[TenantKey, TenantKey]
) -> None:
    a, b = tenants
    assert _chat(gateway, a.key, "secret-sauce").status_code == 200
    assert "secret-sauce" in _models(gateway, a.key)

    assert "secret-sauce" not in _models(gateway, b.key)
    assert not any(a.tenant_id in m for m in _models(gateway, b.key))
    foreign = _chat(gateway, b.key, "secret-sauce")
    qualified = _chat(gateway, b.key, f"{a.tenant_id}/secret-sauce")
    missing = _chat(gateway, b.key, "secret-saucf")
    assert foreign.status_code == qualified.status_code == missing.status_code == 404
    # Indistinguishable from a name that does not exist (apart from echoing the name asked for).
    assert foreign.json()["error"]["message"].replace("secret-sauce", "X") == missing.json()[
        "error"
    ]["message"].replace("secret-saucf", "X")
    assert {k: v for k, v in foreign.json()["error"].items() if k != "message"} == {
        k: v for k, v in missing.json()["error"].items() if k != "message"
    }


def test_shared_adapters_serve_every_tenant(
    gateway: RunningServer, tenants: tuple[TenantKey, TenantKey]
) -> None:
    for t in tenants:
        assert "iso-common" in _models(gateway, t.key)
        assert _chat(gateway, t.key, "iso-common").status_code == 200
        assert _chat(gateway, t.key, "shared/iso-common").status_code == 200


def test_tenant_keys_cannot_reach_admin_routes_or_other_tenants(
    gateway: RunningServer, tenants: tuple[TenantKey, TenantKey]
) -> None:
    a, b = tenants
    for path in (
        "/admin/tenants",
        f"/admin/tenants/{a.tenant_id}",
        f"/admin/tenants/{a.tenant_id}/keys",
    ):
        r = httpx.get(f"{gateway.url}{path}", headers={"authorization": f"Bearer {b.key}"})
        assert r.status_code == 401, (path, r.text)


def _wait_for_status(gateway: RunningServer, key: str, status: int, within: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within:
        r = httpx.get(f"{gateway.url}/v1/models", headers={"authorization": f"Bearer {key}"})
        if r.status_code == status:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"key still answered {r.status_code} after {within} s")


def test_revoked_key_stops_working(
    gateway: RunningServer, admin_m: httpx.Client, tenants: tuple[TenantKey, TenantKey]
) -> None:
    a, _ = tenants
    key_id, key = new_key(admin_m, a.tenant_id)
    assert _chat(gateway, key, "demo-model").status_code == 200
    assert admin_m.delete(f"/admin/keys/{key_id}").status_code in (200, 204)
    _wait_for_status(gateway, key, 401, within=3.0)
    assert _chat(gateway, key, "demo-model").json()["error"]["code"] == "invalid_api_key"
    assert _chat(gateway, a.key, "demo-model").status_code == 200, "other keys keep working"


def test_expired_key_stops_working(
    gateway: RunningServer, admin_m: httpx.Client, tenants: tuple[TenantKey, TenantKey]
) -> None:
    a, _ = tenants
    _, key = new_key(admin_m, a.tenant_id, expires_in=1)
    _wait_for_status(gateway, key, 401, within=5.0)
