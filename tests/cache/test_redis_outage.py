"""Redis stopped and restarted mid-run: the cache answers misses and drops stores, counts the
failures, never raises, and caches again once Redis is back (empty, as after a crash)."""

from __future__ import annotations

from redis.asyncio import Redis

from loramux.cache.embedder import Embedder
from loramux.cache.response_cache import ResponseCache
from tests.cache.conftest import SEMANTIC, answer, chat
from tests.redis import RedisServer


async def test_caching_survives_a_redis_restart(own_redis: RedisServer, embedder: Embedder) -> None:
    client = Redis.from_url(own_redis.url)
    cache = ResponseCache(client, embedder, redis_timeout=0.5)
    await cache.start()
    question, paraphrase = chat("How do I reset my password?"), chat("How can I reset my password?")
    try:
        await cache.store(question, SEMANTIC, answer("Click reset."))
        assert await cache.lookup(paraphrase, SEMANTIC) is not None

        own_redis.stop()
        assert await cache.lookup(question, SEMANTIC) is None
        assert await cache.lookup(paraphrase, SEMANTIC) is None
        await cache.store(question, SEMANTIC, answer("Click reset."))
        assert cache.errors == 3

        own_redis.start()
        assert await cache.lookup(paraphrase, SEMANTIC) is None  # a restart loses every entry
        await cache.store(question, SEMANTIC, answer("Click reset."))
        exact = await cache.lookup(question, SEMANTIC)
        semantic = await cache.lookup(paraphrase, SEMANTIC)
        assert exact is not None and exact.kind == "exact"
        assert semantic is not None and semantic.kind == "semantic"
        assert cache.errors == 3
    finally:
        await client.aclose()


async def test_a_cache_started_while_redis_is_down_works_once_it_is_up(
    own_redis: RedisServer, embedder: Embedder
) -> None:
    own_redis.stop()
    client = Redis.from_url(own_redis.url)
    cache = ResponseCache(client, embedder, redis_timeout=0.5)
    try:
        await cache.start()
        assert cache.errors == 1
        own_redis.start()
        await cache.store(chat("What is the capital of France?"), SEMANTIC, answer("Paris."))
        assert await cache.lookup(chat("What is the capital of France?"), SEMANTIC) is not None
    finally:
        await client.aclose()
