"""Response-cache fixtures: the real embedder (loaded once), real Redis, one keyspace per test."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from loramux.cache.embedder import Embedder
from loramux.cache.response_cache import ResponseCache
from loramux.cache.types import CachedResponse, CachePolicy, CacheRequest

EXACT = CachePolicy(
    lookup=True, store=True, semantic=False, ttl=60, threshold=0.92, verifier="strict"
)
SEMANTIC = CachePolicy(
    lookup=True, store=True, semantic=True, ttl=60, threshold=0.92, verifier="strict"
)

MakeCache = Callable[..., ResponseCache]


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return Embedder()


@pytest.fixture
async def make_cache(redis_url: str, embedder: Embedder) -> AsyncIterator[MakeCache]:
    """Caches sharing one fresh key prefix, each on its own Redis client (as separate gateway
    processes would be)."""
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    clients: list[Redis] = []

    def make(**options: Any) -> ResponseCache:
        client = Redis.from_url(redis_url)
        clients.append(client)
        return ResponseCache(client, embedder, prefix=prefix, **options)

    yield make
    for client in clients:
        await client.aclose()


def chat(
    question: str,
    *,
    tenant: str = "tenant-a",
    adapter: str = "base",
    history: tuple[tuple[str, str], ...] = (("system", "You are a helpful assistant."),),
    **params: Any,
) -> CacheRequest:
    """A chat request: `history`, then the user's `question`; greedy, 32 tokens unless given."""
    merged = {"max_tokens": 32, "temperature": 0.0} | params
    return CacheRequest(
        tenant_id=tenant,
        base_model="demo-model",
        adapter=adapter,
        kind="chat",
        messages=(*history, ("user", question)),
        prompt=None,
        params=tuple(sorted(merged.items())),
    )


def answer(text: str) -> CachedResponse:
    return CachedResponse(text=text, finish_reason="stop", prompt_tokens=12, completion_tokens=5)


async def until_missing(
    cache: ResponseCache, req: CacheRequest, policy: CachePolicy, within: float = 5.0
) -> float:
    """Poll until `req` misses (Redis's own clock expires entries); returns how long it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while await cache.lookup(req, policy) is not None:
        assert loop.time() - start < within, f"entry still served after {within} s"
        await asyncio.sleep(0.05)
    return loop.time() - start
