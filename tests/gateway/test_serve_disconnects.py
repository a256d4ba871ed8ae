"""200 chat streams through a real `loramux serve` (its engine a child process), a random part of
them abandoned by their client at a random moment: once idle, the engine holds no KV block and
no adapter slot pin, and Redis holds no quota reservation."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loramux.adapters.demo import build_demo_adapters
from loramux.gateway.auth.admin_jwt import AdminAuth
from tests.gateway.serve_process import Serve, command_line, serve
from tests.gateway.tenants import new_tenant, upload_adapter
from tests.reliability.books import open_reservations
from tests.reliability.rig import GENEROUS_QUOTAS
from tests.reliability.traffic import Tenant

SECRET = "disconnect-test-secret-" + "x" * 32
STREAMS = 200
IN_FLIGHT = 24
SETTLE_SECONDS = 60.0


@pytest.fixture(scope="module")
def running(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    env = {
        "LORAMUX_MODEL": str(demo_model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_MAX_MODEL_LEN": "512",
        "LORAMUX_KV_CACHE_MB": "4",  # 128 blocks: streams compete for them
        "LORAMUX_ADMIN_SECRET": SECRET,
    }
    with serve(tmp_path_factory.mktemp("serve-disconnects"), env) as running:
        yield running


def _engine_metrics(running: Serve) -> dict[str, float]:
    """The engine child's own /metrics (its health port is on its command line)."""
    cmd = command_line(running.child(" engine "))
    port = re.search(r"--health-port (\d+)", cmd)
    assert port is not None, cmd
    text = httpx.get(f"http://127.0.0.1:{port[1]}/metrics", timeout=10).text
    pairs = (line.split() for line in text.splitlines() if not line.startswith("#"))
    return {name.removeprefix("loramux_"): float(value) for name, value in pairs}


async def _stream(client: httpx.AsyncClient, url: str, key: str, model: str, seed: int) -> str:
    """One stream, read to its end or abandoned at a random moment: how it went."""
    rng = random.Random(seed)
    leave_after = rng.choice([None, None, 0, 1, 3, 8])  # events read before leaving
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"story {seed}: " + "once " * rng.randrange(40)}],
        "max_tokens": rng.randrange(4, 40),
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        if leave_after == 0:
            return "left before reading"
        events = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if leave_after is not None and events >= leave_after:
                    return "left"
    return "done"


async def _abandoned_mid_request(client: httpx.AsyncClient, url: str, key: str, seed: int) -> str:
    """A stream whose client leaves before the response's head arrives (or just after)."""
    task = asyncio.create_task(_stream(client, url, key, "demo-model", seed))
    await asyncio.sleep(random.Random(seed).uniform(0.0, 0.05))  # a random moment, not a wait
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def _traffic(url: str, key: str) -> Counter[str]:
    gate = asyncio.Semaphore(IN_FLIGHT)
    limits = httpx.Limits(max_connections=IN_FLIGHT * 2)

    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=60), limits=limits) as client:

        async def one(i: int) -> str:
            async with gate:
                if i % 5 == 0:
                    return await _abandoned_mid_request(client, url, key, i)
                return await _stream(client, url, key, "story" if i % 2 else "demo-model", i)

        async with asyncio.timeout(300):
            return Counter(await asyncio.gather(*(one(i) for i in range(STREAMS))))


def test_streams_abandoned_at_random_leave_no_kv_block_pin_or_reservation_behind(
    running: Serve, demo_model_dir: Path, tmp_path: Path
) -> None:
    token = AdminAuth(SECRET).mint("disconnect-test")
    with httpx.Client(
        base_url=running.url, headers={"authorization": f"Bearer {token}"}, timeout=60
    ) as admin:
        tenant = new_tenant(admin, "disconnects")
        r = admin.put(f"/admin/tenants/{tenant.tenant_id}/quotas", json=GENEROUS_QUOTAS)
        assert r.status_code == 200, r.text
        [folder] = build_demo_adapters(demo_model_dir, tmp_path, 1)
        upload_adapter(admin, tenant.tenant_id, "story", folder)

    outcomes = asyncio.run(_traffic(running.url, tenant.key))
    assert outcomes["done"] and outcomes["left"] and outcomes["cancelled"], outcomes

    redis_url = f"unix://{(running.data_dir / 'redis' / 'redis.sock').resolve()}"
    tenants = [Tenant(tenant.tenant_id, tenant.key_id, tenant.key)]
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        engine = _engine_metrics(running)
        held = {
            k: engine[k]
            for k in (
                "num_requests_running",
                "num_requests_waiting",
                "kv_cache_usage_perc",
                "lora_slots_pinned",
            )
        }
        reservations = open_reservations(redis_url, tenants)
        if not any(held.values()) and not reservations:
            break
        assert time.monotonic() < deadline, f"still held once idle: {held}, {reservations}"
        time.sleep(0.1)
    assert engine["engine_aborted_requests_total"] > 0, (
        "abandoned streams were meant to abort engine sequences"
    )
    assert httpx.get(f"{running.url}/health", timeout=10).json()["status"] == "ok"
