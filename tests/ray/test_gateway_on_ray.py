"""loramux as one Ray Serve application: 2 gateway replicas (the Litestar app as the ingress)
and 3 CPU engine replicas, over one Redis and one SQLite database."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from loramux.engine.demo_model import EOS_TOKEN_IDS
from loramux.engine.ray_deployment import EngineDeploymentOptions
from loramux.gateway.db import UsageEvent
from loramux.gateway.settings import Settings
from loramux.gateway.state import admin_auth
from tests.gateway.servers import demo_env
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter
from tests.postgres import free_port
from tests.ray.conftest import ENGINE_REPLICAS, serve, start_ray, stop_ray
from tests.reliability.books import open_reservations
from tests.reliability.traffic import Tenant

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

    env = demo_env(
        demo_model_dir,
        LORAMUX_DATA_DIR=str(tmp_path_factory.mktemp("ray-gateway-data")),
        LORAMUX_KEY_CACHE_SECONDS="0.5",
        # adapters reach the engine replicas through the database, not the gateways' folder
        LORAMUX_ADAPTER_STORE_URL="db",
    )
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


async def test_an_adapter_uploaded_through_a_gateway_serves_from_an_engine_replica_until_deleted(
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
    while (stats := await holder.stats.remote()).served.get(uploaded["digest"]) != 1:
        assert time.monotonic() < deadline, "no engine replica reports serving the upload"
    # ... and it did so from a folder of its own, filled from the database (no shared folder)
    gateway_folder = ray_gateway.settings.adapter_dir
    assert Path(stats.adapter_root) != gateway_folder
    assert (Path(stats.adapter_root) / uploaded["digest"]).is_dir()

    # Deleted through one gateway, every gateway refuses it once its catalog cache (2 s) ends,
    # so no engine replica gets a new request for it.
    assert admin.delete(f"/admin/adapters/{tenant.tenant_id}/late").status_code < 300
    deadline, refusals = time.monotonic() + 30, 0
    while refusals < 8:  # in a row, from whichever gateway replicas answer
        gone = await chat(ray_gateway.url, tenant, "late")
        assert gone.status_code in (200, 404), gone.text
        refusals = refusals + 1 if gone.status_code == 404 else 0
        assert time.monotonic() < deadline, "a gateway still serves the deleted adapter"


async def test_a_deleted_tenants_adapter_weights_leave_the_engine_replicas_disk(
    ray_gateway: RayGateway, admin: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    """Deleting a tenant deletes its adapters' files from the gateway's store and the shared
    store; the engine replica that fetched a copy is told by no one (a handle reaches one
    replica), and finds out within about a second by asking the shared store. The copy used to
    stay on the replica's disk for good."""
    tenant = new_tenant(admin)
    digest = upload_adapter(admin, tenant.tenant_id, "secret", demo_adapter_dirs[21])["digest"]
    r = await chat(ray_gateway.url, tenant, "secret")
    assert r.status_code == 200, r.text
    engines = serve.get_deployment_handle("LoramuxEngine", app_name="loramux")
    stats = await engines.options(multiplexed_model_id=digest).stats.remote()
    # The replicas of a host share one root, a run folder each: the stats may come from a
    # replica other than the one that served (the router only prefers that one).
    runs = Path(stats.adapter_root).parent
    assert list(runs.glob(f"run-*/{digest}")), "the replica that served it fetched a copy"

    deleted = admin.delete(f"/admin/tenants/{tenant.tenant_id}")
    assert deleted.status_code == 200, deleted.text
    assert not (ray_gateway.settings.adapter_dir / digest).exists()
    deadline = time.monotonic() + 30  # a second's check, slow on 2 shared cores
    while list(runs.glob(f"run-*/{digest}")):
        assert time.monotonic() < deadline, "the deleted tenant's weights stay on the replica"
        await asyncio.sleep(0.05)


@dataclass
class StreamEnd:
    status: int
    finished: bool
    """A finish reason and `data: [DONE]` arrived."""
    error: str | None
    """The error event that ended the stream, if one did."""


async def stream_chat(url: str, tenant: TenantKey, model: str, first: asyncio.Event) -> StreamEnd:
    """A 300-token stream: the end-of-sequence tokens are biased out, so no stream ends early
    (on a busy machine one that ended between the replicas' stats and the kill was no longer
    there to be cut)."""
    headers = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}
    body = chat_body(model, max_tokens=300, stream=True)
    body["logit_bias"] = {str(token): -100 for token in EOS_TOKEN_IDS}
    finished, error = False, None
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as c,
        c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            first.set()
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                finished = error is None
                break
            if '"error"' in data:
                error = data
        return StreamEnd(r.status_code, finished, error)


def usage_rows(settings: Settings, tenant_id: str) -> list[UsageEvent]:
    engine = create_engine(settings.database_url.replace("sqlite:", "sqlite+pysqlite:", 1))
    try:
        with Session(engine) as s:
            return list(s.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tenant_id)))
    finally:
        engine.dispose()


async def test_killing_an_engine_replica_during_12_streams_ends_each_cleanly_and_settles_the_books(
    ray_gateway: RayGateway, admin: httpx.Client, demo_adapter_dirs: list[Path], redis_url: str
) -> None:
    tenant = new_tenant(admin)
    uploads = [
        upload_adapter(admin, tenant.tenant_id, f"k{n}", demo_adapter_dirs[24 + n])
        for n in range(3)
    ]
    models = ["demo-model"] + [u["name"] for u in uploads]
    engines = serve.get_deployment_handle("LoramuxEngine", app_name="loramux")
    firsts = [asyncio.Event() for _ in range(12)]
    streams = [
        asyncio.ensure_future(stream_chat(ray_gateway.url, tenant, models[i % 4], firsts[i]))
        for i in range(12)
    ]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
    # The busiest replica among those holding the four models (asked by model id, each call
    # reaches a holder) is killed while its streams run. A stream's first event (its role)
    # comes before the engine runs it: a replica may still be fetching an adapter, so the
    # replicas are asked until one is running streams.
    deadline = time.monotonic() + 120
    while True:
        seen = [
            await engines.options(multiplexed_model_id=m).stats.remote()
            for m in ["base"] + [u["digest"] for u in uploads]
        ]
        victim = max(seen, key=lambda s: s.engine["running"])
        if victim.engine["running"] > 0:
            break
        assert time.monotonic() < deadline, "no replica ran the streams"
        await asyncio.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)

    ends = await asyncio.wait_for(asyncio.gather(*streams), 300)  # no client hangs
    assert all(e.status == 200 for e in ends)
    assert all(e.finished != (e.error is not None) for e in ends), ends
    assert any(e.error is not None for e in ends), "the killed replica's streams were cut"
    assert all("engine" in (e.error or "engine") for e in ends), ends

    deadline = time.monotonic() + 120
    while True:  # Ray Serve brings the engine replica back
        state = serve.status().applications["loramux"].deployments["LoramuxEngine"]
        replicas = [await engines.stats.remote() for _ in range(ENGINE_REPLICAS)]
        if state.replica_states.get("RUNNING") == ENGINE_REPLICAS and victim.pid not in {
            r.pid for r in replicas
        }:
            break
        assert time.monotonic() < deadline, "the killed engine replica was not replaced"
    again = await chat(ray_gateway.url, tenant, "demo-model")
    assert again.status_code == 200, again.text

    books = Tenant(tenant.tenant_id, tenant.key_id, tenant.key)
    while (
        open_reservations(redis_url, [books])
        or len(usage_rows(ray_gateway.settings, tenant.tenant_id)) < 13
    ):
        assert time.monotonic() < deadline + 60, "reservations left open or usage rows missing"
        await asyncio.sleep(0.1)
    rows = usage_rows(ray_gateway.settings, tenant.tenant_id)
    assert len(rows) == 13 and len({r.request_id for r in rows}) == 13


async def test_a_killed_gateway_replica_is_restarted_and_the_other_keeps_serving(
    ray_gateway: RayGateway, admin: httpx.Client
) -> None:
    tenant = new_tenant(admin)
    gateways = serve.get_deployment_handle("LoramuxGateway", app_name="loramux")
    victim = await gateways.process.remote()
    os.kill(victim, signal.SIGKILL)
    answers = await asyncio.gather(*(chat(ray_gateway.url, tenant, "demo-model") for _ in range(4)))
    assert all(a.status_code in (200, 502, 503) for a in answers), [a.text for a in answers]

    deadline = time.monotonic() + 120
    while True:
        state = serve.status().applications["loramux"].deployments["LoramuxGateway"]
        pids = {await gateways.process.remote() for _ in range(6)}
        if state.replica_states.get("RUNNING") == 2 and len(pids) == 2 and victim not in pids:
            break
        assert time.monotonic() < deadline, "the killed gateway replica was not replaced"
    for _ in range(4):
        r = await chat(ray_gateway.url, tenant, "demo-model")
        assert r.status_code == 200, r.text
