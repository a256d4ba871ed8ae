"""Once a request is admitted and misses the response cache, the gateway registers its adapter
on the engine if the engine lacks it and hints the engine to load it: a cold adapter starts
loading before the request arrives, and a refused request touches no adapter."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from loramux.gateway.engine_client.local import LocalEngineClient
from loramux.gateway.server import RunningServer
from tests.gateway.servers import gateway_server
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter

PROMPT = [{"role": "user", "content": "Say something about adapters"}]


@pytest.fixture(autouse=True)
def one_adapter_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAMUX_MAX_LORAS", "1")  # and so one adapter in host memory
    monkeypatch.setenv("LORAMUX_MAX_CPU_LORAS", "1")


def _tenant_with(
    server: RunningServer, adapters: dict[str, Path], **quotas: int
) -> tuple[TenantKey, dict[str, str]]:
    """A new tenant owning `adapters` (uploaded by name), its key under `quotas`; with the
    adapters' digests."""
    token = server.state.admin.mint("test-admin", ttl_seconds=600)
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as admin:
        tenant = new_tenant(admin, "prefetch")
        digests = {
            name: upload_adapter(admin, tenant.tenant_id, name, folder)["digest"]
            for name, folder in adapters.items()
        }
        if quotas:
            r = admin.put(f"/admin/keys/{tenant.key_id}/quotas", json=quotas)
            assert r.status_code == 200, r.text
    return tenant, digests


def test_an_admitted_request_for_an_evicted_adapter_starts_its_load_by_a_hint(
    demo_model_dir: Path,
    demo_adapter_dirs: list[Path],
    tmp_path: Path,
    redis_url: str,
) -> None:
    with gateway_server(demo_model_dir, tmp_path / "data", redis_url) as server:
        adapters = {"cold": demo_adapter_dirs[0], "warm": demo_adapter_dirs[1]}
        tenant, _ = _tenant_with(server, adapters)
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=tenant.key, max_retries=0, timeout=60
        )
        # One adapter fits in host memory: each request finds its adapter evicted by the other.
        for model in ("cold", "warm", "cold"):
            out = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=2)  # type: ignore[arg-type]
            assert out.choices[0].message.content is not None

        engine = server.state.engine
        assert isinstance(engine, LocalEngineClient)
        stats = engine.engine.adapter_stats()
        assert sorted(s.requests for s in stats.values()) == [1, 2]
        for s in stats.values():  # each request's read from disk was started by its hint
            assert s.hinted_loads == s.requests


def test_a_refused_request_touches_no_adapter_even_one_the_engine_lacks(
    demo_model_dir: Path,
    demo_adapter_dirs: list[Path],
    tmp_path: Path,
    redis_url: str,
) -> None:
    """Over its limits, a tenant cannot make the engine read its adapters from disk, evicting
    other tenants' adapters from host memory: neither by a hint, nor, after a restart (the
    engine then has no adapter registered), by the registration a first request makes."""
    adapters = {"warm": demo_adapter_dirs[1], "cold": demo_adapter_dirs[0]}
    with gateway_server(demo_model_dir, tmp_path / "data", redis_url) as server:
        tenant, digests = _tenant_with(server, adapters, rpm=1)
    for restarted in (False, True):
        with gateway_server(demo_model_dir, tmp_path / "data", redis_url) as server:
            client = openai.OpenAI(
                base_url=f"{server.url}/v1", api_key=tenant.key, max_retries=0, timeout=60
            )
            if not restarted:
                client.chat.completions.create(model="warm", messages=PROMPT, max_tokens=2)  # type: ignore[arg-type]
            for _ in range(2):
                with pytest.raises(openai.RateLimitError):
                    client.chat.completions.create(model="cold", messages=PROMPT, max_tokens=2)  # type: ignore[arg-type]
            engine = server.state.engine
            assert isinstance(engine, LocalEngineClient)
            stats = engine.engine.adapter_stats()
            cold = stats.get(digests["cold"])
            assert cold is None or (cold.loads, cold.hinted_loads, cold.requests) == (0, 0, 0)
