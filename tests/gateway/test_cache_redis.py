"""With LORAMUX_CACHE_REDIS_URL the response cache lives on a Redis of its own: cache entries
land only there and quota state only on LORAMUX_REDIS_URL, so a cache that evicts under memory
pressure can never evict a rate window, a concurrency lease or a budget ledger."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from loramux.gateway.db.migrate import upgrade
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import CacheSettings, EngineSettings, ServerSettings, Settings
from tests.gateway.conftest import json_of
from tests.gateway.tenants import new_tenant
from tests.redis import RedisServer


@pytest.fixture(scope="module")
def two_redis(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisServer, RedisServer]]:
    """(the quota Redis, the cache Redis)."""
    servers = (
        RedisServer(tmp_path_factory.mktemp("quota-redis")),
        RedisServer(tmp_path_factory.mktemp("cache-redis")),
    )
    for server in servers:
        server.start()
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def split_gateway(
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    two_redis: tuple[RedisServer, RedisServer],
) -> Iterator[RunningServer]:
    quota_redis, cache_redis = two_redis
    data = tmp_path_factory.mktemp("split-redis-gateway")
    settings = Settings(
        data_dir=data,
        model=demo_model_dir,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=16),
        server=ServerSettings(model_name="demo-model"),
        cache=CacheSettings(redis_url=cache_redis.url),
    )
    upgrade(settings.database_url)
    client = engine_client(settings, demo_model_dir)
    with serve_in_thread(settings, client, demo_model_dir, redis_url=quota_redis.url) as server:
        yield server


def keys(server: RedisServer) -> list[str]:
    client = redis.Redis.from_url(server.url)
    try:
        return sorted(k.decode() for k in client.scan_iter(count=1000))
    finally:
        client.close()


def test_cache_entries_and_quota_state_live_on_their_own_redis(
    split_gateway: RunningServer, two_redis: tuple[RedisServer, RedisServer]
) -> None:
    quota_redis, cache_redis = two_redis
    token = split_gateway.state.admin.mint("test-admin", ttl_seconds=600)
    with httpx.Client(
        base_url=split_gateway.url, headers={"authorization": f"Bearer {token}"}, timeout=120
    ) as admin:
        tenant = new_tenant(admin, "split")
        limits = {"rpm": 100, "max_concurrent": 4, "token_budget": 100_000, "budget_period": "day"}
        assert (
            admin.put(f"/admin/tenants/{tenant.tenant_id}/quotas", json=limits).status_code == 200
        )
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "Which Redis holds what?"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    headers = {"authorization": f"Bearer {tenant.key}"}
    with httpx.Client(base_url=split_gateway.url, headers=headers, timeout=120) as api:
        outcomes = [api.post("/v1/chat/completions", json=body) for _ in range(2)]
    assert [r.status_code for r in outcomes] == [200, 200], outcomes[0].text
    assert [r.headers["x-cache"] for r in outcomes] == ["miss", "exact"]
    assert json_of(outcomes[1])["choices"] == json_of(outcomes[0])["choices"]

    quota_keys, cache_keys = keys(quota_redis), keys(cache_redis)
    assert quota_keys and all(k.startswith("lmx:q:") for k in quota_keys), quota_keys
    assert cache_keys and all(k.startswith("lmx:rc") for k in cache_keys), cache_keys
