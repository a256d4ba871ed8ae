"""Nearest-neighbour search on the Redis server itself, with Redis 8 vector sets.

One vector set per semantic bucket (`BucketKeys.vset`, in the bucket's scope of tenant, adapter
digest and conversation, so purges and isolation work as for the core index). Each element is
named by its response key, so storing an entry again replaces it; it holds the question's
embedding, quantized to int8 by the server (`Q8`), and the attributes {"q": question,
"x": expiry in ms}. A search is one `VSIM` with the query vector: the server walks its HNSW graph
with exploration factor `ef`, skips expired elements (`FILTER .x > now`) and returns the best
matches with their attributes. `VSIM` scores are (1 + cosine) / 2; candidates carry the cosine.

An add is one script (`scripts.VADD`) that checks the request's fence (`cache.types.Fence`) before
it adds. Vector sets keep no per-element lifetime or use order: expired elements stop being returned at
once and go when the bucket key expires (each store extends it to the longest entry lifetime);
a bucket past `max_entries` after an add drops elements chosen at random (the core index evicts
the least recently used one instead).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from loramux.cache import scripts
from loramux.cache.keys import BucketKeys
from loramux.cache.semantic_index import Candidate, Read, run_reads
from loramux.cache.types import Fence
from loramux.cache.vectors import F32

DEFAULT_EF = 200
"""HNSW exploration factor of a search: buckets of some thousands of entries are searched all but
exhaustively (an approximate index must not lose a paraphrase's match), and a search of 20,000
int8 vectors takes about 1.3 ms on one core (500: 2.6 ms)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class VectorSetIndex:
    """Semantic buckets as Redis 8 vector sets. Redis errors propagate, as for `CoreVectorIndex`."""

    def __init__(self, redis: Redis, dim: int, *, max_entries: int, ef: int = DEFAULT_EF):
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.redis = redis
        self.dim = dim
        self.max_entries = max_entries
        self.ef = ef
        self._add = redis.register_script(scripts.VADD)

    async def load_scripts(self) -> None:
        """Nothing to load: the add script loads itself when the server lacks it."""

    async def add(
        self,
        bucket: BucketKeys,
        vector: F32,
        question: str,
        response_key: str,
        ttl: int,
        fence: Fence | None = None,
    ) -> bool:
        """Insert (or replace) the entry for `response_key`; False when its `fence` refused it
        (a purge since the request's lookup). Unfenced, only a deleted tenant refuses it."""
        attributes = json.dumps({"q": question, "x": _now_ms() + ttl * 1000})
        epochs, seen = (fence.keys, fence.args()) if fence is not None else ((), ["*"] * 6)
        size = await self._add(
            keys=[bucket.vset, *epochs],
            args=[*seen, vector.astype("<f4").tobytes(), response_key, attributes, ttl],
        )
        excess = int(size) - self.max_entries
        if int(size) < 0 or excess <= 0:
            return int(size) >= 0
        # Distinct random members, one more than needed so the new entry can be spared.
        sample = await self.redis.execute_command("VRANDMEMBER", bucket.vset, excess + 1)
        victims = [m for m in sample if m != response_key.encode()][:excess]
        async with self.redis.pipeline(transaction=False) as pipe:
            for victim in victims:
                pipe.execute_command("VREM", bucket.vset, victim)
            await pipe.execute()
        return True

    async def prefetch(self, bucket: BucketKeys, also_read: Sequence[Read] = ()) -> list[Any]:
        """The replies to `also_read` (nothing to bring up to date: the search runs on the
        server)."""
        return await run_reads(self.redis, also_read) if also_read else []

    async def nearest(
        self, bucket: BucketKeys, query: F32, threshold: float, limit: int
    ) -> list[Candidate]:
        """Up to `limit` unexpired entries with cosine similarity ≥ threshold, best first."""
        reply: dict[Any, Any] = await self.redis.execute_command(
            "VSIM", bucket.vset, "FP32", query.astype("<f4").tobytes(),
            "WITHSCORES", "WITHATTRIBS", "COUNT", limit, "EF", max(self.ef, limit),
            "FILTER", f".x > {_now_ms()}",
        )  # fmt: skip
        found = []
        for name, (score, raw) in (reply or {}).items():
            similarity = 2.0 * float(score) - 1.0
            if similarity < threshold or raw is None:
                continue
            meta = json.loads(raw)
            key = name.decode() if isinstance(name, bytes) else str(name)
            found.append(Candidate(-1, similarity, meta["q"], key, int(meta["x"])))
        return sorted(found, key=lambda c: -c.similarity)

    async def fetch(self, bucket: BucketKeys, candidate: Candidate) -> bytes | None:
        """The candidate's response (None if gone)."""
        return _as_bytes(await self.redis.get(candidate.response_key))


def _as_bytes(value: bytes | str | None) -> bytes | None:
    """GET's reply (the response cache's client returns bytes; the typing allows str)."""
    return value.encode() if isinstance(value, str) else value
