"""`GET /v1/models/{model}` answers for every model `GET /v1/models` lists, scoped to the
caller's tenant; `system_fingerprint` names what produced an answer (engine build, base model,
adapter digest)."""

from __future__ import annotations

from pathlib import Path

import httpx

from loramux.gateway.openai.models import system_fingerprint
from loramux.gateway.server import RunningServer
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter


def get(gateway: RunningServer, key: str, path: str) -> httpx.Response:
    return httpx.get(f"{gateway.url}/v1{path}", headers={"authorization": f"Bearer {key}"})


def fingerprint(gateway: RunningServer, tenant: TenantKey, model: str) -> str:
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        headers={"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    value: str = r.json()["system_fingerprint"]
    return value


def test_every_listed_model_is_retrievable_and_another_tenants_is_not(
    gateway: RunningServer, admin_module: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    a, b = new_tenant(admin_module, "models-a"), new_tenant(admin_module, "models-b")
    upload_adapter(admin_module, a.tenant_id, "mine", demo_adapter_dirs[3])
    upload_adapter(admin_module, "shared", "mine", demo_adapter_dirs[4])  # shadowed for a
    listed = get(gateway, a.key, "/models").json()["data"]
    assert {"demo-model", "mine", "shared/mine"} <= {m["id"] for m in listed}
    for model in listed:
        r = get(gateway, a.key, f"/models/{model['id']}")
        assert r.status_code == 200, r.text
        assert r.json() == model
    foreign = get(gateway, b.key, f"/models/{a.tenant_id}/mine")
    unknown = get(gateway, b.key, "/models/no-such-model")
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"
    assert get(gateway, b.key, "/models/mine").json()["id"] == "mine"  # b sees the shared one


def test_the_fingerprint_changes_with_the_adapter_digest_only(
    gateway: RunningServer, admin_module: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    tenant = new_tenant(admin_module, "fingerprint")
    base = fingerprint(gateway, tenant, "demo-model")
    assert base.startswith("fp_") and base == fingerprint(gateway, tenant, "demo-model")
    first = upload_adapter(admin_module, tenant.tenant_id, "tuned", demo_adapter_dirs[5])
    v1 = fingerprint(gateway, tenant, "tuned")
    assert v1 == fingerprint(gateway, tenant, "tuned") and v1 != base
    second = upload_adapter(admin_module, tenant.tenant_id, "tuned", demo_adapter_dirs[6])
    assert first["digest"] != second["digest"]
    v2 = fingerprint(gateway, tenant, "tuned")  # same name, new weights
    assert v2 not in (v1, base)
    assert v2 == system_fingerprint("demo-model", second["digest"])


def test_the_fingerprint_changes_with_the_base_model() -> None:
    assert system_fingerprint("demo-model", None) != system_fingerprint("other-model", None)
