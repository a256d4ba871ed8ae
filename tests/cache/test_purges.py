"""A purge is final: an answer a request made before it (its lookup came first) is never written
after it, nor is anything of a deleted tenant, whichever process stores it.

Each test interleaves the race by hand: a request's lookup (`begin`), then the purge (another
process's, through its own client), then the request's store carrying the fence it read."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import redis.exceptions
from redis.asyncio import Redis

from loramux.cache.embedder import Embedder
from loramux.cache.response_cache import ResponseCache
from loramux.cache.types import MAX_TTL, CachePolicy, CacheRequest
from tests.cache.conftest import EXACT, SEMANTIC, MakeCache, answer, chat
from tests.redis import RedisServer

QUESTION = "How do I reset my password?"
ADAPTER = "a" * 64


async def scope_keys(cache: ResponseCache, tenant_id: str) -> list[bytes]:
    """Every key in the tenant's scope: entries, request records, semantic buckets."""
    pattern = cache.keys.scope(tenant_id) + "*"
    return [key async for key in cache.redis.scan_iter(match=pattern)]


async def store_after_purge(
    asker: ResponseCache, purger: ResponseCache, req: CacheRequest, policy: CachePolicy, **purge
) -> None:
    """`asker` looks `req` up (a miss), `purger` purges, then `asker` stores its answer."""
    consulted = await asker.begin(req, policy, "req-1")
    assert consulted.hit is None and consulted.fence is not None
    await purger.purge(req.tenant_id, **purge)
    await asker.store(req, policy, answer("Click reset."), "req-1", consulted.fence)


@pytest.mark.parametrize("policy", [EXACT, SEMANTIC], ids=["exact", "semantic"])
@pytest.mark.parametrize("scope", ["tenant", "adapter"])
async def test_an_answer_looked_up_before_a_purge_is_not_stored_after_it(
    make_cache: MakeCache, policy: CachePolicy, scope: str
) -> None:
    asker, purger = make_cache(), make_cache()
    req = chat(QUESTION, adapter=ADAPTER)
    purge = {"adapter": ADAPTER} if scope == "adapter" else {}
    await store_after_purge(asker, purger, req, policy, **purge)
    assert await scope_keys(asker, "tenant-a") == []
    assert asker.stats.stores == 0 and asker.stats.fenced == 1
    # The purge is behind the next request: its answer is kept.
    consulted = await asker.begin(req, policy)
    await asker.store(req, policy, answer("Click reset."), None, consulted.fence)
    assert await asker.lookup(req, policy) is not None


async def test_a_purge_of_another_adapter_or_tenant_leaves_the_store_alone(
    make_cache: MakeCache,
) -> None:
    asker, purger = make_cache(), make_cache()
    await asker.start()  # the server's incarnation, which the lookup reads into its fence
    req = chat(QUESTION, adapter=ADAPTER)
    consulted = await asker.begin(req, EXACT)
    await purger.purge("tenant-a", "b" * 64)
    await purger.purge("tenant-b")
    await asker.store(req, EXACT, answer("Click reset."), None, consulted.fence)
    assert await asker.lookup(req, EXACT) is not None


async def test_the_semantic_index_refuses_an_entry_looked_up_before_a_purge(
    make_cache: MakeCache,
) -> None:
    """The core index's add checks the fence in its own script (`scripts.ADD`), as the entry's
    store does: the embedder runs between the two, and a purge may come in that gap."""
    asker, purger = make_cache(), make_cache()
    req = chat(QUESTION)
    consulted = await asker.begin(req, SEMANTIC)
    assert consulted.fence is not None
    await purger.purge("tenant-a", "base")
    bucket = asker.keys.bucket(req, asker.embedder.model_id)
    vector = await asker.embedder.embed_whole(QUESTION)
    assert vector is not None
    entry = asker.keys.exact(req)
    assert not await asker.index.add(bucket, vector, QUESTION, entry, 60, consulted.fence)
    assert await scope_keys(asker, "tenant-a") == []


async def test_a_hit_read_before_a_purge_records_no_request_after_it(
    make_cache: MakeCache,
) -> None:
    """The record a hit leaves (for wrong-hit reports) is fenced like the entry."""
    asker, purger = make_cache(), make_cache()
    req = chat(QUESTION)
    await asker.store(req, EXACT, answer("Click reset."))
    consulted = await asker.begin(req, dataclasses.replace(EXACT, store=False))
    assert consulted.hit is not None and consulted.fence is not None
    entry = asker.keys.exact(req)
    await purger.purge("tenant-a")
    await asker._remember_request("tenant-a", "req-2", entry, consulted.fence)
    assert await scope_keys(asker, "tenant-a") == []


@pytest.mark.parametrize("policy", [EXACT, SEMANTIC], ids=["exact", "semantic"])
async def test_a_deleted_tenant_has_nothing_stored_ever_after(
    make_cache: MakeCache, policy: CachePolicy
) -> None:
    """Requests another process still admits after the delete (its key cache) look up after
    the purge, and are refused all the same; so is a store that carries no fence."""
    asker, purger = make_cache(), make_cache()
    req = chat(QUESTION)
    await asker.store(req, policy, answer("Click reset."), "req-0")
    assert await purger.purge("tenant-a", tenant_deleted=True) == 1
    consulted = await asker.begin(req, policy, "req-1")
    assert consulted.hit is None
    await asker.store(req, policy, answer("Click reset."), "req-1", consulted.fence)
    await asker.store(req, policy, answer("Click reset."), "req-2")
    assert await scope_keys(asker, "tenant-a") == []
    # A later purge of its scopes keeps the tombstone; it lasts the longest entry lifetime.
    await purger.purge("tenant-a")
    await asker.store(req, policy, answer("Click reset."))
    assert await scope_keys(asker, "tenant-a") == []
    tombstone = await asker.redis.hget(asker.keys.incarnation, asker.keys.epoch("tenant-a"))
    assert tombstone is not None and tombstone.startswith(b"gone:")
    expiry = int(tombstone.rsplit(b"@", 1)[1]) / 1000
    seconds, microseconds = await asker.redis.time()
    assert MAX_TTL - 60 < expiry - (seconds + microseconds / 1e6) <= MAX_TTL
    # Other tenants store as before.
    other = chat(QUESTION, tenant="tenant-b")
    await asker.store(other, policy, answer("Click reset."))
    assert await asker.lookup(other, policy) is not None


async def test_a_redis_restart_between_lookup_and_store_does_not_undo_a_purge(
    own_redis: RedisServer, embedder: Embedder
) -> None:
    """The cache Redis keeps nothing across a restart (no persistence), the purge's epochs and
    a deleted tenant's tombstone included: the store is refused because its lookup read another
    incarnation of the server (`Fence`), not because the epochs still say so."""
    asker = ResponseCache(Redis.from_url(own_redis.url), embedder)
    purger = ResponseCache(Redis.from_url(own_redis.url), embedder)
    try:
        for cache in (asker, purger):
            await cache.start()
        req = chat(QUESTION)
        consulted = await asker.begin(req, EXACT, "req-1")
        assert consulted.hit is None and consulted.fence is not None
        await purger.purge("tenant-a", tenant_deleted=True)
        own_redis.restart()
        for cache in (asker, purger):  # reconnected (a restart drops every connection)
            with contextlib.suppress(redis.exceptions.ConnectionError):
                await cache.redis.ping()
            assert await cache.redis.ping()
        await asker.store(req, EXACT, answer("Click reset."), "req-1", consulted.fence)
        assert asker.stats.errors == 0
        assert asker.stats.stores == 0 and asker.stats.fenced == 1
        assert await purger.lookup(req, EXACT) is None
        # The next request reads the new incarnation: caching resumes.
        consulted = await asker.begin(req, EXACT)
        await asker.store(req, EXACT, answer("Click reset."), None, consulted.fence)
        assert asker.stats.stores == 1 and await purger.lookup(req, EXACT) is not None
    finally:
        await asker.redis.aclose()
        await purger.redis.aclose()


async def test_a_purge_after_a_redis_restart_goes_through(
    own_redis: RedisServer, embedder: Embedder
) -> None:
    """A Redis restart closes the pooled connections, and the first command on one fails: a
    tenant's delete, already committed, then answered 500 and left its cache unpurged (found
    by a test order in which the PostgreSQL gateway's cache Redis had restarted). A purge tries
    once more, on a new connection."""
    cache = ResponseCache(Redis.from_url(own_redis.url), embedder)
    req = chat(QUESTION)
    try:
        await cache.start()
        await cache.store(req, EXACT, answer("Click reset."))
        own_redis.restart()
        assert await cache.purge(req.tenant_id, tenant_deleted=True) == 0  # a fresh server
        consulted = await cache.begin(req, EXACT)
        await cache.store(req, EXACT, answer("Click reset."), None, consulted.fence)
        assert await cache.lookup(req, EXACT) is None  # the tombstone holds
    finally:
        await cache.redis.aclose()


async def test_a_purge_stays_final_on_a_cache_redis_that_evicts(
    own_redis: RedisServer, embedder: Embedder
) -> None:
    """Bug: the cache Redis evicts any key (`allkeys-lru`, docker/compose.yaml), and the purge
    epochs were keys of their own: once other tenants' traffic evicted a purged scope's epoch,
    it read '' as if never purged, and an answer looked up before the purge was written after
    it, and served. The epochs are fields of the incarnation's hash: evicted with it, or not
    at all, and a write whose lookup read an incarnation the server no longer has is refused."""
    client = Redis.from_url(own_redis.url)
    await client.config_set("maxmemory", "4mb")
    await client.config_set("maxmemory-policy", "allkeys-lru")
    cache = ResponseCache(client, embedder, prefix="evicting")
    await cache.start()
    try:
        purged = chat(QUESTION, tenant="tnt_purged")
        consulted = await cache.begin(purged, EXACT, "req-1")  # before the purge
        assert consulted.hit is None and consulted.fence is not None
        await cache.purge("tnt_purged")
        # Other tenants' traffic, until the cache Redis evicts the purged scope's epoch.
        for n in range(20_000):
            other = chat(f"Question number {n}?", tenant=f"tnt_other{n % 50}")
            await cache.begin(other, EXACT)
            await cache.store(other, EXACT, answer("x" * 4096))
            if await client.hget(cache.keys.incarnation, cache.keys.epoch("tnt_purged")) is None:
                break
        else:
            pytest.fail("the purge epoch was never evicted")
        await cache.store(purged, EXACT, answer("made before the purge"), None, consulted.fence)
        assert await cache.lookup(purged, EXACT) is None
    finally:
        await client.aclose()
