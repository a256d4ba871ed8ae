"""`GET /v1/models/{model}` answers for every model `GET /v1/models` lists, scoped to the
caller's tenant; `system_fingerprint` names what produced an answer (engine build, base model
and its weights, adapter digest)."""

from __future__ import annotations

from pathlib import Path

import httpx

from loramux.engine.demo_model import build_demo_model
from loramux.engine.identity import engine_build, model_identity
from loramux.gateway.openai.models import system_fingerprint
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import admin_client
from tests.gateway.servers import gateway_server
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


def test_every_model_id_a_completion_answers_with_is_retrievable(
    gateway: RunningServer, admin_module: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    """A completion takes `owner/name` (by tenant name or id), `shared/name` and `name@version`
    and answers with that `model`; retrieving it gives the adapter it names. The bug: only the
    ids the list shows were found, so a client checking the model it was answered by got 404."""
    a, b = new_tenant(admin_module, "models-ids-a"), new_tenant(admin_module, "models-ids-b")
    upload_adapter(admin_module, a.tenant_id, "solo", demo_adapter_dirs[3])
    upload_adapter(admin_module, "shared", "pub", demo_adapter_dirs[4])
    listed = {m["id"]: m for m in get(gateway, a.key, "/models").json()["data"]}
    ids = {
        f"{a.tenant_name}/solo": "solo",
        f"{a.tenant_id}/solo": "solo",
        "solo@1": "solo",
        "shared/pub": "pub",
        "pub@1": "pub",
    }
    for model, listed_as in ids.items():
        assert fingerprint(gateway, a, model).startswith("fp_")
        r = get(gateway, a.key, f"/models/{model}")
        assert r.status_code == 200, (model, r.text)
        assert r.json() == listed[listed_as] | {"id": model}
    for foreign in (f"{a.tenant_id}/solo", f"{a.tenant_name}/solo", "solo@1", "solo@2"):
        r = get(gateway, b.key, f"/models/{foreign}")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found"), foreign


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
    settings = gateway.state.settings
    identity = model_identity(settings.model_dir, settings.engine.dtype)
    served = f"demo-model@{identity}"
    assert v2 == system_fingerprint(engine_build(), served, second["digest"])


def test_the_fingerprint_changes_with_the_base_model_and_the_engine_build() -> None:
    build, base = engine_build(), "demo-model@" + "0" * 64
    assert system_fingerprint(build, base, None) != system_fingerprint(build, "other", None)
    assert system_fingerprint(build, base, None) != system_fingerprint("1" * 64, base, None)


def test_the_fingerprint_changes_with_the_base_weights_under_the_same_name(
    demo_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    """The same fingerprint means the same code, weights and adapter: two checkpoints served
    under one name answer with two fingerprints."""
    upgraded = build_demo_model(tmp_path / "demo-model-v2", seed=1)
    fingerprints = []
    for model_dir, name in ((demo_model_dir, "a"), (upgraded, "b")):
        (tmp_path / name).mkdir()
        with gateway_server(model_dir, tmp_path / name, redis_url) as gw, admin_client(gw) as a:
            fingerprints.append(fingerprint(gw, new_tenant(a, "fp"), "demo-model"))
    assert fingerprints[0] != fingerprints[1]
