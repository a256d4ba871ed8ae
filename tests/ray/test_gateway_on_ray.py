"""loramux as one Ray Serve application: 2 gateway replicas (the Litestar app as the ingress)
and 3 CPU engine replicas, over one Redis and one SQLite database."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loramux.engine.ray_deployment import EngineDeploymentOptions
from loramux.gateway.settings import Settings
from loramux.gateway.state import admin_auth
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter
from tests.postgres import free_port
from tests.ray.conftest import ENGINE_REPLICAS, serve, start_ray, stop_ray

pytestmark = pytest.mark.ray


@dataclass
class RayGateway:
    url: str
    settings: Settings
    admin_token: str


@pytest.fixture(scope="module")
def ray_gateway(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[RayGateway]:
    from loramux.gateway.ray_app import GatewayDeploymentOptions, loramux_application

    env = {
        "LORAMUX_DATA_DIR": str(tmp_path_factory.mktemp("ray-gateway-data")),
        "LORAMUX_MODEL": str(demo_model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_MAX_MODEL_LEN": "512",
        "LORAMUX_KV_CACHE_MB": "32",
        "LORAMUX_KEY_CACHE_SECONDS": "0.5",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    port = free_port()
    try:
        settings = Settings()
        start_ray(http_port=port)
        app = loramux_application(
            settings,
            redis_url,
            GatewayDeploymentOptions(num_replicas=2, num_cpus=0.25),
            EngineDeploymentOptions(num_replicas=ENGINE_REPLICAS, num_cpus=0.5),
        )
        serve.run(app, name="loramux", route_prefix="/")
        token = admin_auth(settings).mint("ray-test-admin", ttl_seconds=3600)
        yield RayGateway(f"http://127.0.0.1:{port}", settings, token)
    finally:
        stop_ray()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def admin(ray_gateway: RayGateway) -> Iterator[httpx.Client]:
    headers = {"authorization": f"Bearer {ray_gateway.admin_token}"}
    with httpx.Client(base_url=ray_gateway.url, headers=headers, timeout=120) as c:
        yield c


def chat_body(model: str, max_tokens: int = 4, stream: bool = False) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "def main():"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def chat(url: str, tenant: TenantKey, model: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        return await c.post("/v1/chat/completions", json=chat_body(model), headers=headers)


async def test_a_rate_limit_admits_exactly_n_across_the_gateway_replicas(
    ray_gateway: RayGateway, admin: httpx.Client
) -> None:
    tenant = new_tenant(admin)
    r = admin.put(f"/admin/tenants/{tenant.tenant_id}/quotas", json={"rpm": 5})
    assert r.status_code == 200, r.text
    answers = await asyncio.gather(
        *(chat(ray_gateway.url, tenant, "demo-model") for _ in range(12))
    )
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] * 5 + [429] * 7, [a.text for a in answers if a.status_code >= 500]
    gateways = serve.status().applications["loramux"].deployments["LoramuxGateway"]
    assert gateways.replica_states.get("RUNNING") == 2


async def test_an_adapter_uploaded_through_a_gateway_serves_from_an_engine_replica(
    ray_gateway: RayGateway, admin: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    tenant = new_tenant(admin)
    uploaded = upload_adapter(admin, tenant.tenant_id, "late", demo_adapter_dirs[20])
    r = await chat(ray_gateway.url, tenant, "late")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    # No engine replica saw the upload: the one Ray Serve picked loaded it from the store.
    engines = serve.get_deployment_handle("LoramuxEngine", app_name="loramux")
    holder = engines.options(multiplexed_model_id=uploaded["digest"])
    deadline = time.monotonic() + 60
    while (await holder.stats.remote()).served.get(uploaded["digest"]) != 1:
        assert time.monotonic() < deadline, "no engine replica reports serving the upload"
