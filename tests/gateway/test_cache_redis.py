"""With LORAMUX_CACHE_REDIS_URL the response cache lives on a Redis of its own: cache entries
land only there and quota state only on LORAMUX_REDIS_URL, so a cache that evicts under memory
pressure can never evict a rate window, a concurrency lease or a budget ledger."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from loramux.cache.keys import Keyspace
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import CacheSettings, EngineSettings, ServerSettings, Settings
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.servers import TcpRelay
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


@contextlib.contextmanager
def split_redis_gateway(
    model_dir: Path, data: Path, quota_redis_url: str, cache_redis_url: str
) -> Iterator[RunningServer]:
    """A gateway whose response cache lives on `cache_redis_url`, its quota state elsewhere."""
    settings = Settings(
        data_dir=data,
        model=model_dir,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=16),
        server=ServerSettings(model_name="demo-model"),
        cache=CacheSettings(redis_url=cache_redis_url),
    )
    upgrade(settings.database_url)
    client = engine_client(settings, model_dir)
    with serve_in_thread(settings, client, model_dir, redis_url=quota_redis_url) as server:
        yield server


@pytest.fixture(scope="module")
def split_gateway(
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    two_redis: tuple[RedisServer, RedisServer],
) -> Iterator[RunningServer]:
    quota_redis, cache_redis = two_redis
    data = tmp_path_factory.mktemp("split-redis-gateway")
    with split_redis_gateway(demo_model_dir, data, quota_redis.url, cache_redis.url) as gw:
        yield gw


@pytest.fixture
def relayed_cache_gateway(
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    two_redis: tuple[RedisServer, RedisServer],
) -> Iterator[tuple[RunningServer, TcpRelay]]:
    """A gateway whose cache Redis is reached through a relay the test can block."""
    quota_redis, cache_redis = two_redis
    relay = TcpRelay(cache_redis.port)
    data = tmp_path_factory.mktemp("relayed-cache-gateway")
    try:
        with split_redis_gateway(demo_model_dir, data, quota_redis.url, relay.redis_url) as gw:
            yield gw, relay
    finally:
        relay.close()


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


def test_a_tenant_delete_the_cache_redis_misses_commits_and_purges_it_later(
    relayed_cache_gateway: tuple[RunningServer, TcpRelay],
    two_redis: tuple[RedisServer, RedisServer],
) -> None:
    """A tenant's delete commits before its purge: with the cache Redis unreachable it answers
    200 saying its cache was not purged (audited `ok`), and the purge, with its tombstone, is
    retried until the cache Redis answers again."""
    gw, relay = relayed_cache_gateway
    _, cache_redis = two_redis
    with admin_client(gw) as admin:
        tenant = new_tenant(admin, "gone")
        body = {"model": "demo-model", "messages": [{"role": "user", "content": "Kept?"}]}
        headers = {"authorization": f"Bearer {tenant.key}"}
        answer = httpx.post(
            f"{gw.url}/v1/chat/completions",
            json=body | {"max_tokens": 2, "temperature": 0},
            headers=headers,
        )
        assert answer.status_code == 200, answer.text
        gw.run(gw.state.cache.drain())
        scope = Keyspace().scope(tenant.tenant_id)
        assert any(k.startswith(scope) for k in keys(cache_redis))

        relay.block()
        deleted = admin.delete(f"/admin/tenants/{tenant.tenant_id}")
        assert deleted.status_code == 200, deleted.text
        assert "cache" in json_of(deleted)["note"] and "cache_entries" not in deleted.text
        assert admin.get(f"/admin/tenants/{tenant.tenant_id}").status_code == 404
        entry = next(
            e for e in json_of(admin.get("/admin/audit"))["items"] if e["action"] == "tenant.delete"
        )
        assert (entry["target"], entry["outcome"]) == (tenant.tenant_id, "ok"), entry
        assert "note" in entry["detail"]
        relay.unblock()

    def purged() -> bool:
        return not any(k.startswith(scope) for k in keys(cache_redis))

    deadline = time.monotonic() + 60
    while not purged():
        assert time.monotonic() < deadline, "the deleted tenant's cache was never purged"
        time.sleep(0.05)
    where = Keyspace()
    tombstone = redis.Redis.from_url(cache_redis.url).hget(
        where.incarnation, where.epoch(tenant.tenant_id)
    )
    assert tombstone is not None and tombstone.startswith(b"gone:"), tombstone
    assert tenant.tenant_id not in gw.state.cache.deleted_tenants.pending
