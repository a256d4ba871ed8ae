"""The core-Redis vector index: search agrees with brute force, and every process's in-memory
copy of a bucket follows what other processes add, evict and delete."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis

from loramux.cache.keys import BucketKeys, Keyspace
from loramux.cache.semantic_index import CoreVectorIndex
from tests.cache.conftest import chat

DIM = 384
MakeIndex = Callable[..., CoreVectorIndex]


def unit_vectors(n: int, seed: int, centers: int = 20) -> np.ndarray:
    """Clustered unit vectors, as questions on a few topics are."""
    rng = np.random.default_rng(seed)
    middle = rng.standard_normal((centers, DIM))
    x = middle[rng.integers(0, centers, n)] + 0.8 * rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def near(v: np.ndarray, seed: int, noise: float = 0.02) -> np.ndarray:
    q = v + noise * np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return (q / np.linalg.norm(q)).astype(np.float32)


@pytest.fixture
def bucket() -> BucketKeys:
    return Keyspace(f"test-{uuid.uuid4().hex[:8]}").bucket(chat("q"), "test-embedder")


@pytest.fixture
async def make_index(redis_url: str) -> AsyncIterator[MakeIndex]:
    clients: list[Redis] = []

    def make(**options: Any) -> CoreVectorIndex:
        clients.append(Redis.from_url(redis_url))
        return CoreVectorIndex(clients[-1], DIM, **({"max_entries": 10_000} | options))

    yield make
    for client in clients:
        await client.aclose()


async def add_all(
    index: CoreVectorIndex, bucket: BucketKeys, vectors: np.ndarray, tag: str
) -> None:
    for i, v in enumerate(vectors):
        await index.add(bucket, v, f"{tag} {i}", f"response:{tag}:{i}", ttl=60)


async def test_search_agrees_with_brute_force(make_index: MakeIndex, bucket: BucketKeys) -> None:
    index = make_index(rerank=64)
    vectors = unit_vectors(2000, seed=1)
    await add_all(index, bucket, vectors, "v")
    for i in range(0, 2000, 97):
        query = near(vectors[i], seed=i)
        found = await index.search(bucket, query, threshold=0.9, limit=4)
        assert found, i
        assert found[0].response_key == f"response:v:{int(np.argmax(vectors @ query))}"
        assert abs(found[0].similarity - float(vectors[i] @ query)) < 0.01
        assert all(c.similarity >= 0.9 for c in found)


async def test_a_copy_follows_another_process_adds_and_evictions(
    make_index: MakeIndex, bucket: BucketKeys
) -> None:
    reader, writer = make_index(max_entries=50), make_index(max_entries=50)
    vectors = unit_vectors(80, seed=2)
    await add_all(writer, bucket, vectors[:10], "v")
    assert len(await reader.search(bucket, vectors[0], threshold=0.99, limit=1)) == 1
    for i in range(10, 80):
        await writer.add(bucket, vectors[i], f"v {i}", f"response:v:{i}", ttl=60)
    for i in (0, 29):  # evicted: the 30 least recently used of 80
        assert await reader.search(bucket, vectors[i], threshold=0.99, limit=1) == []
    for i in (30, 79):
        [hit] = await reader.search(bucket, vectors[i], threshold=0.99, limit=1)
        assert hit.response_key == f"response:v:{i}"
    assert await writer.redis.zcard(bucket.lru) == 50


async def test_a_copy_too_far_behind_reloads_the_bucket(
    make_index: MakeIndex, bucket: BucketKeys
) -> None:
    reader, writer = make_index(max_delta=8), make_index()
    vectors = unit_vectors(40, seed=3)
    await add_all(writer, bucket, vectors[:2], "v")
    assert await reader.search(bucket, vectors[0], threshold=0.99, limit=1)
    await add_all(writer, bucket, vectors[2:], "w")
    [hit] = await reader.search(bucket, vectors[39], threshold=0.99, limit=1)
    assert hit.response_key == "response:w:37"


async def test_a_deleted_and_recreated_bucket_is_not_confused_with_the_old_one(
    make_index: MakeIndex, bucket: BucketKeys
) -> None:
    reader, writer = make_index(), make_index()
    old, new = unit_vectors(3, seed=4), unit_vectors(3, seed=5)
    await add_all(writer, bucket, old, "old")
    assert await reader.search(bucket, old[1], threshold=0.99, limit=1)
    await writer.redis.delete(*bucket.all())
    assert await reader.search(bucket, old[1], threshold=0.99, limit=1) == []
    await add_all(writer, bucket, new, "new")
    assert await reader.search(bucket, old[1], threshold=0.99, limit=1) == []
    [hit] = await reader.search(bucket, new[1], threshold=0.99, limit=1)
    assert hit.response_key == "response:new:1"


async def test_storing_an_entry_again_refreshes_its_slot(
    make_index: MakeIndex, bucket: BucketKeys
) -> None:
    index = make_index()
    v = unit_vectors(1, seed=6)[0]
    await index.add(bucket, v, "q", "response:x", ttl=60)
    await index.add(bucket, v, "q", "response:x", ttl=120)
    assert await index.redis.zcard(bucket.lru) == 1
    [hit] = await index.search(bucket, v, threshold=0.99, limit=4)
    assert hit.response_key == "response:x"


async def test_copies_beyond_the_memory_budget_are_dropped_and_rebuilt(
    make_index: MakeIndex, redis_url: str
) -> None:
    index = make_index(mirror_bytes=1)
    space = Keyspace(f"test-{uuid.uuid4().hex[:8]}")
    buckets = [space.bucket(chat("q", tenant=f"t{i}"), "e") for i in range(3)]
    vectors = unit_vectors(3, seed=7)
    for b, v in zip(buckets, vectors, strict=True):
        await index.add(b, v, "q", "response", ttl=60)
    for _ in range(2):
        for b, v in zip(buckets, vectors, strict=True):
            assert len(await index.search(b, v, threshold=0.99, limit=1)) == 1
    assert index.mirror_count == 1
