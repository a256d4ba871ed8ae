"""The exact cache: a hit needs every component of the request to be equal."""

from __future__ import annotations

import dataclasses

import pytest
from redis.asyncio import Redis

from loramux.cache.embedder import Embedder
from loramux.cache.response_cache import ResponseCache
from loramux.cache.types import CachedResponse, CacheRequest
from tests.cache.conftest import EXACT, MakeCache, answer, chat, until_missing
from tests.redis import RedisServer

BASE = chat("What is the capital of France?", seed=None, stop=["\n"])


def _variants() -> dict[str, CacheRequest]:
    """BASE with exactly one component changed."""

    def param(name: str, value: object) -> CacheRequest:
        params = dict(BASE.params) | {name: value}
        return dataclasses.replace(BASE, params=tuple(sorted(params.items())))

    assert BASE.messages is not None
    return {
        "tenant": dataclasses.replace(BASE, tenant_id="tenant-b"),
        "base model": dataclasses.replace(BASE, base_model="another-model"),
        "adapter version": dataclasses.replace(BASE, adapter="f" * 64),
        "kind": dataclasses.replace(
            BASE, kind="text", messages=None, prompt="What is the capital of France?"
        ),
        "system prompt": dataclasses.replace(
            BASE, messages=(("system", "You are terse."), BASE.messages[1])
        ),
        "last message": dataclasses.replace(
            BASE, messages=(BASE.messages[0], ("user", "What is the capital of france?"))
        ),
        "a role": dataclasses.replace(
            BASE, messages=(("user", BASE.messages[0][1]), BASE.messages[1])
        ),
        "max_tokens": param("max_tokens", 33),
        "temperature": param("temperature", 0.5),
        "top_p": param("top_p", 0.9),
        "top_k": param("top_k", 40),
        "seed": param("seed", 7),
        "stop": param("stop", ["."]),
        "response_format": param("response_format", '{"type":"json_object"}'),
    }


async def test_identical_requests_hit(make_cache: MakeCache) -> None:
    cache = make_cache()
    await cache.store(BASE, EXACT, answer("Paris."))
    hit = await cache.lookup(dataclasses.replace(BASE), EXACT)
    assert hit is not None and hit.kind == "exact" and hit.similarity is None
    assert hit.response == answer("Paris.")


@pytest.mark.parametrize("component", list(_variants()))
async def test_changing_any_component_misses(make_cache: MakeCache, component: str) -> None:
    cache = make_cache()
    await cache.store(BASE, EXACT, answer("Paris."))
    assert await cache.lookup(_variants()[component], EXACT) is None
    assert await cache.lookup(BASE, EXACT) is not None


async def test_text_prompt_as_string_and_as_token_ids_are_different_entries(
    make_cache: MakeCache,
) -> None:
    cache = make_cache()
    as_text = dataclasses.replace(BASE, kind="text", messages=None, prompt="123")
    as_ids = dataclasses.replace(as_text, prompt=(1, 2, 3))
    await cache.store(as_text, EXACT, answer("four"))
    assert await cache.lookup(as_ids, EXACT) is None
    await cache.store(as_ids, EXACT, answer("4"))
    hit = await cache.lookup(as_ids, EXACT)
    assert hit is not None and hit.response.text == "4"


async def test_policy_without_lookup_or_store_neither_reads_nor_writes(
    make_cache: MakeCache,
) -> None:
    cache = make_cache()
    await cache.store(BASE, dataclasses.replace(EXACT, store=False), answer("Paris."))
    assert await cache.lookup(BASE, EXACT) is None
    await cache.store(BASE, EXACT, answer("Paris."))
    assert await cache.lookup(BASE, dataclasses.replace(EXACT, lookup=False)) is None
    assert cache.stats.exact_hits == 0 and cache.stats.stores == 1


async def test_entries_expire_after_their_ttl(make_cache: MakeCache) -> None:
    cache = make_cache()
    await cache.store(BASE, dataclasses.replace(EXACT, ttl=1), answer("Paris."))
    assert await cache.lookup(BASE, EXACT) is not None
    await until_missing(cache, BASE, EXACT)


async def test_purge_removes_one_tenant_or_one_adapter(make_cache: MakeCache) -> None:
    cache = make_cache()
    a_base = BASE
    a_adapter = dataclasses.replace(BASE, adapter="a" * 64)
    b_base = dataclasses.replace(BASE, tenant_id="tenant-b")
    for req in (a_base, a_adapter, b_base):
        await cache.store(req, EXACT, answer("Paris."))

    assert await cache.purge("tenant-a", "a" * 64) == 1
    assert await cache.lookup(a_adapter, EXACT) is None
    assert await cache.lookup(a_base, EXACT) is not None

    assert await cache.purge("tenant-a") == 1
    assert await cache.lookup(a_base, EXACT) is None
    assert await cache.lookup(b_base, EXACT) is not None
    assert await cache.purge("tenant-a") == 0


async def test_purge_patterns_cannot_reach_other_tenants(make_cache: MakeCache) -> None:
    """Tenant ids are hashed into keys: an id full of glob characters matches only itself."""
    cache = make_cache()
    await cache.store(BASE, EXACT, answer("Paris."))
    assert await cache.purge("*") == 0
    assert await cache.purge("tenant-*") == 0
    assert await cache.lookup(BASE, EXACT) is not None


async def test_a_store_redis_refuses_leaves_no_request_record(
    own_redis: RedisServer, embedder: Embedder
) -> None:
    """Out of memory (noeviction), Redis refuses the entry: the request's record, written in the
    same round trip, goes with it, so a wrong-hit report on that request finds nothing."""
    client = Redis.from_url(own_redis.url)
    cache = ResponseCache(client, embedder, redis_timeout=5.0)
    await cache.start()
    try:
        used = (await client.info("memory"))["used_memory"]
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", used + (1 << 20))
        req = chat("Summarise the manual.")
        big = CachedResponse(
            text="x" * (4 << 20), finish_reason="length", prompt_tokens=4, completion_tokens=9
        )
        await cache.store(req, EXACT, big, request_id="req_big")
        assert cache.errors == 1, "the entry was refused"
        assert await client.get(cache.keys.exact(req)) is None
        assert await client.get(cache.keys.request(req.tenant_id, "req_big")) is None
        assert not await cache.report_wrong_hit(req.tenant_id, "req_big")
    finally:
        await client.aclose()


async def test_a_hit_stays_reportable_for_as_long_as_its_entry_lives(
    make_cache: MakeCache,
) -> None:
    """Bug: a hit's request record took the hit's policy TTL, not its entry's: an entry stored
    for a day and hit by a tenant whose TTL is 1 s stayed served, but the report of that hit
    was refused a second later. The record now lives as long as the entry it names."""
    cache = make_cache()
    question = chat("What is the refund window for damaged items?")
    await cache.store(question, dataclasses.replace(EXACT, ttl=86400), answer("a wrong answer"))
    short_lived = dataclasses.replace(EXACT, ttl=1)
    hit = (await cache.begin(question, short_lived, "req_hit")).hit
    assert hit is not None and hit.kind == "exact"
    entry = cache.keys.exact(question)
    record = cache.keys.request(question.tenant_id, "req_hit")
    assert await cache.redis.ttl(record) > 3600
    assert abs(await cache.redis.pttl(record) - await cache.redis.pttl(entry)) < 60_000
    assert await cache.report_wrong_hit(question.tenant_id, "req_hit")
    assert await cache.lookup(question, short_lived) is None
