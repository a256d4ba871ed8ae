"""Nearest-neighbour search over one bucket's vectors, with core Redis data only (no modules).

Redis holds each bucket (see `cache.keys.BucketKeys`): the records of all slots packed into one
string, the live slots' metadata, LRU and expiry order, and a log of changed slots. Writes are
one Lua script each (`scripts.ADD`): check the request's fence (`cache.types.Fence`), sweep
expired entries, evict least recently used ones while the bucket is full, write the record in
place (SETRANGE), log the slot.

Each process keeps an in-memory copy of the buckets it searches (`BucketMirror`). A lookup first
`refresh`es the copy — one round trip that asks for the slots changed since the copy's log
position (`scripts.SYNC`) and can read more keys alongside (the exact entry, the purge epochs) —
so an entry stored by any process is seen by the next lookup in every process. `candidates` then
scores the copy with numpy, locally, and `fetch` reads the chosen entry's response and marks it
used, in one more round trip. A copy too far behind (or of an older incarnation of the bucket)
is reloaded whole. Copies are dropped, least recently used first, beyond `mirror_bytes`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError

from loramux.cache import scripts
from loramux.cache.keys import BucketKeys
from loramux.cache.types import Fence
from loramux.cache.vectors import F32, BucketMirror, encode, record_size

MAX_DELTA = 4096
"""A copy further behind than this many changes reloads the whole bucket."""
LOG_CAP = 8192
"""The change log is cut to half this length when it grows past it."""
MAX_MIRRORS = 10_000

_SCRIPTS = {"add": scripts.ADD, "sync": scripts.SYNC, "load": scripts.LOAD}
_SHA = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in _SCRIPTS.items()}


@dataclass(frozen=True)
class Candidate:
    """A live entry whose vector is within the threshold of the query."""

    slot: int
    similarity: float
    question: str
    response_key: str
    expires_ms: int


@dataclass
class _Mirror:
    copy: BucketMirror
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    counted: int = 0
    """The copy's size as last added to the index's running total."""


def _now_ms() -> int:
    return int(time.time() * 1000)


Read = tuple[str, list[str], list[Any]]
"""A read queued with others in one round trip: ("mget", keys, []) or ("hmget", [key], fields)."""

_READS: dict[str, Callable[[Pipeline, list[str], list[Any]], object]] = {
    "mget": lambda pipe, keys, _: pipe.mget(keys),
    "hmget": lambda pipe, keys, fields: pipe.hmget(keys[0], fields),
}


async def run_reads(redis: Redis, reads: Sequence[Read]) -> list[Any]:
    """The replies to `reads`, read in one round trip."""
    async with redis.pipeline(transaction=False) as pipe:
        for name, keys, args in reads:
            _READS[name](pipe, keys, args)
        return list(await pipe.execute())


class CoreVectorIndex:
    """Semantic buckets on core Redis. Redis errors propagate; the caller decides what a failure
    means (the response cache turns them into misses)."""

    def __init__(
        self,
        redis: Redis,
        dim: int,
        *,
        max_entries: int,
        mirror_bytes: int = 256 << 20,
        rerank: int = 256,
        max_delta: int = MAX_DELTA,
    ):
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.redis = redis
        self.dim = dim
        self.max_entries = max_entries
        self.mirror_bytes = mirror_bytes
        self.rerank = rerank
        self.max_delta = max_delta
        self._record_size = record_size(dim)
        self._mirrors: OrderedDict[str, _Mirror] = OrderedDict()
        self._mirror_total = 0

    @property
    def mirror_count(self) -> int:
        """Buckets this process holds a copy of."""
        return len(self._mirrors)

    async def load_scripts(self) -> None:
        """Load the Lua scripts (they are reloaded by themselves when a server forgot them)."""
        for text in _SCRIPTS.values():
            await self.redis.script_load(text)

    async def add(
        self,
        bucket: BucketKeys,
        vector: F32,
        question: str,
        response_key: str,
        ttl: int,
        fence: Fence | None = None,
    ) -> bool:
        """Insert (or refresh) the entry for `response_key`, evicting as the bucket needs;
        False when its `fence` refused it (a purge since the request's lookup)."""
        now = _now_ms()
        meta = json.dumps({"k": response_key, "q": question, "x": now + ttl * 1000})
        args = [now, ttl * 1000, encode(vector), meta, response_key, self.max_entries]
        args += [self._record_size, LOG_CAP, secrets.token_hex(8)]
        keys = bucket.all()
        if fence is not None:
            keys, args = [*keys, *fence.keys], [*args, *fence.args()]
        (slot,) = await self._run([("add", keys, args)])
        return slot is not None

    async def search(
        self, bucket: BucketKeys, query: F32, threshold: float, limit: int
    ) -> list[Candidate]:
        """`refresh`, then `candidates`."""
        await self.refresh(bucket)
        return self.candidates(bucket, query, threshold, limit)

    async def refresh(self, bucket: BucketKeys, also_read: Sequence[Read] = ()) -> list[Any]:
        """Bring this process's copy of the bucket up to date; returns the replies to
        `also_read`, read in the same round trip."""
        mirror = self._mirrors.get(bucket.info)
        if mirror is None:
            mirror = self._mirrors[bucket.info] = _Mirror(BucketMirror(self.dim))
        self._mirrors.move_to_end(bucket.info)
        keys = [bucket.info, bucket.vectors, bucket.meta, bucket.log]
        async with mirror.lock:
            copy = mirror.copy
            args = [copy.epoch, copy.applied, self.max_delta, self._record_size]
            reads: list[tuple[str, list[str], list[Any]]] = [("sync", keys, args)]
            reads[:0] = also_read
            replies = await self._run(reads)
            reply = replies[-1]
            if reply[0] and reply[2] == b"reload":
                reply = (await self._run([("load", keys, [])]))[0]
                if reply[0]:
                    metas = [(int(s), m) for s, m in zip(reply[3::2], reply[4::2], strict=True)]
                    copy.load(reply[0].decode(), int(reply[1]), reply[2], metas)
            elif reply[0]:
                _apply(copy, reply)
        if reply[0]:
            self._mirror_total += copy.nbytes - mirror.counted
            mirror.counted = copy.nbytes
            self._shrink(keep=bucket.info)
        else:
            self._drop(bucket.info)
        return list(replies[: len(also_read)])

    async def prefetch(self, bucket: BucketKeys, also_read: Sequence[Read] = ()) -> list[Any]:
        """`refresh` (what a lookup does before it knows its query vector)."""
        return await self.refresh(bucket, also_read)

    async def nearest(
        self, bucket: BucketKeys, query: F32, threshold: float, limit: int
    ) -> list[Candidate]:
        """`candidates`, after a `prefetch` of the bucket."""
        return self.candidates(bucket, query, threshold, limit)

    def candidates(
        self, bucket: BucketKeys, query: F32, threshold: float, limit: int
    ) -> list[Candidate]:
        """Up to `limit` live, unexpired entries with similarity ≥ threshold, best first, from
        this process's copy as of the last `refresh` (no Redis access)."""
        mirror = self._mirrors.get(bucket.info)
        if mirror is None:
            return []
        copy = mirror.copy
        slots, sims = copy.nearest(query, self.rerank)
        now = _now_ms()
        found: list[Candidate] = []
        for slot, similarity in zip(slots.tolist(), sims.tolist(), strict=True):
            raw = copy.meta[slot]
            if similarity < threshold or len(found) == limit:
                break
            if raw is None:
                continue
            meta = json.loads(raw)
            if meta["x"] > now:
                found.append(Candidate(slot, similarity, meta["q"], meta["k"], meta["x"]))
        return found

    async def fetch(self, bucket: BucketKeys, candidate: Candidate) -> bytes | None:
        """The candidate's response (None if gone), marking the entry as just used (least
        recently used entries are evicted first)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(candidate.response_key)
            pipe.zadd(bucket.lru, {str(candidate.slot): _now_ms()}, xx=True)
            response, _ = await pipe.execute()
        return response

    async def _run(self, commands: list[Read]) -> list[Any]:
        """Run reads (`Read`) and scripts (by name) in one round trip; loads the scripts and
        retries once when the server does not know them (after a restart)."""
        for attempt in range(2):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for name, keys, args in commands:
                        if name in _READS:
                            _READS[name](pipe, keys, args)
                        else:
                            pipe.evalsha(_SHA[name], len(keys), *keys, *args)
                    return await pipe.execute()
            except NoScriptError:
                if attempt:
                    raise
                await self.load_scripts()
        raise AssertionError("unreachable")

    def _drop(self, name: str) -> None:
        mirror = self._mirrors.pop(name, None)
        if mirror is not None:
            self._mirror_total -= mirror.counted

    def _shrink(self, keep: str) -> None:
        """Drop the least recently searched copies while over the memory or count budget."""
        for name in list(self._mirrors):
            if self._mirror_total <= self.mirror_bytes and len(self._mirrors) <= MAX_MIRRORS:
                return
            if name != keep:
                self._drop(name)


def _apply(copy: BucketMirror, reply: list[Any]) -> None:
    """Apply a SYNC delta: triples of (slot, record, meta), both b'' when no longer live."""
    changes = reply[3:]
    for i in range(0, len(changes), 3):
        copy.put(int(changes[i]), changes[i + 1] or None, changes[i + 2] or None)
    copy.applied = int(reply[1])
