"""The response cache: exact entries, then semantic ones, on Redis, scoped per tenant and adapter.

A lookup first reads the exact entry (one GET). On a miss, when the policy allows semantic
hits, it embeds the last user message and searches the request's bucket (`cache.keys`) for the
most similar earlier questions; a candidate at or above the threshold becomes a hit only when
the verifier accepts it (`cache.verifier`, with word vectors for soft alignment, on a thread)
and its response entry still exists. A store writes the exact entry and, when semantic, adds the
question to its bucket, pointing at that entry. A question longer than the embedder reads
(`Embedder.embed_whole`) is neither looked up nor stored semantically: its vector would not see
its tail.

Given a request id, a lookup that hits and a store both record which entry the request was
answered from (tenant-scoped, for the entry's lifetime), so an admin can report a wrong answer
by request id: `report_wrong_hit` deletes the entry, and the next identical request misses.

A purge is final for what came before it: writes carry a `Fence` (see `cache.purge`).

A lookup waits for its question's embedding and its candidates' word vectors (the verifier's,
`Embedder.learn_words`) at most `embed_timeout` seconds in all, and a tenant with
`Embedder.max_waiting` texts already waiting gets none (`Backlogged`): either is a plain miss,
counted in `stats.embed_skipped` (and `stats.errors`, the `loramux_response_cache_errors_total`
series); the embedder serves tenants in turn, so this
bounds what one tenant's flood of long questions costs the others. A store whose tenant is
backlogged stores the exact entry only.

Failure is a miss, never an error: every Redis failure (down, restarting, slow beyond
`redis_timeout`) and every embedder failure is logged (at most once per `log_every` seconds per
operation), counted in `stats.errors`, and answered with None. The Redis client reconnects by
itself and the Lua scripts are reloaded when a restarted server has forgotten them, so caching
resumes when Redis is back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Sequence

import redis.asyncio
from redis.exceptions import ResponseError

from loramux.cache import scripts
from loramux.cache.embedder import Backlogged, Embedder
from loramux.cache.keys import BucketKeys, Keyspace, semantic_question
from loramux.cache.purge import DeletedTenantPurges, purge_scope
from loramux.cache.semantic_index import Candidate, CoreVectorIndex, Read, run_reads
from loramux.cache.tenant_stats import NEAR_MISS_MARGIN, CacheStats, TenantCacheStats
from loramux.cache.types import (
    INCARNATION_ID,
    CachedResponse,
    CacheHit,
    CachePolicy,
    CacheRequest,
    Consulted,
    Fence,
    decode_response,
    encode_response,
)
from loramux.cache.verifier import Verdict, parse, verify
from loramux.cache.vset_index import VectorSetIndex

log = logging.getLogger(__name__)


class ResponseCache:
    def __init__(
        self,
        redis: redis.asyncio.Redis,
        embedder: Embedder,
        *,
        max_entries_per_bucket: int = 10_000,
        prefix: str = "lmx:rc",
        mirror_bytes: int = 256 << 20,
        redis_timeout: float = 1.0,
        candidates: int = 4,
        log_every: float = 10.0,
        vector_sets: bool = True,
        embed_timeout: float = 5.0,
    ):
        self.redis = redis
        self.embedder = embedder
        self.keys = Keyspace(prefix)
        self.max_entries_per_bucket = max_entries_per_bucket
        self.vector_sets = vector_sets
        """Search with the server's vector sets when it has them (Redis 8); else core data."""
        self.index: CoreVectorIndex | VectorSetIndex = CoreVectorIndex(
            redis, embedder.dim, max_entries=max_entries_per_bucket, mirror_bytes=mirror_bytes
        )
        self.redis_timeout = redis_timeout
        self.embed_timeout = embed_timeout
        """A lookup's wait for its question's embedding at most; then a miss."""
        self.candidates = candidates
        self.log_every = log_every
        self.stats = CacheStats()
        self.tenants: dict[str, TenantCacheStats] = {}
        """Per-tenant decisions (`cache.tenant_stats`), since this process started."""
        self.vector_search: str | None = None
        """The server's own vector search, if any ("vset" or "search"); None on core Redis."""
        self._last_log: dict[str, float] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._store_script = redis.register_script(scripts.STORE)
        self._remember_script = redis.register_script(scripts.REMEMBER)
        self._purge_epoch = redis.register_script(scripts.PURGE_EPOCH)
        self.deleted_tenants = DeletedTenantPurges(
            functools.partial(self.purge, tenant_deleted=True)
        )

    @property
    def errors(self) -> int:
        return self.stats.errors

    async def start(self) -> None:
        """Check the client, load the Lua scripts, give a fresh server its incarnation (so the
        first requests' stores are not refused for reading none) and detect its vector search.

        Never raises for Redis errors: a server that is down now is used once it is up.
        """
        kwargs = self.redis.connection_pool.connection_kwargs
        if kwargs.get("decode_responses"):
            raise ValueError("the response cache needs a Redis client with decode_responses=False")
        try:
            async with asyncio.timeout(self.redis_timeout):
                await self.index.load_scripts()
                await self.redis.hsetnx(self.keys.incarnation, INCARNATION_ID, secrets.token_hex(8))
                self.vector_search = await self._detect_vector_search()
        except Exception as exc:
            self._failed("start", exc)
            return
        if self.vector_search == "vset" and self.vector_sets:
            self.index = VectorSetIndex(
                self.redis, self.embedder.dim, max_entries=self.max_entries_per_bucket
            )
        log.info(
            "response cache on Redis; server vector search: %s (searching with %s)",
            self.vector_search or "none",
            "vector sets" if isinstance(self.index, VectorSetIndex) else "core data",
        )

    async def _detect_vector_search(self) -> str | None:
        """Redis 8 vector sets (VSIM) or the search module (FT.*), when the server has them."""
        for command, name in (("VSIM", "vset"), ("FT.SEARCH", "search")):
            try:
                await self.redis.execute_command(command)
            except ResponseError as exc:
                if "unknown command" in str(exc).lower():
                    continue
            return name
        return None

    def tenant_stats(self, tenant_id: str) -> TenantCacheStats:
        return self.tenants.setdefault(tenant_id, TenantCacheStats())

    def decision_counts(self) -> dict[str, int]:
        """Near misses, refusals by check (`refused_<check>`) and wrong hits, over all tenants."""
        counts: Counter[str] = Counter()
        for s in self.tenants.values():
            counts["near_miss"] += s.near_misses
            counts["wrong_hit"] += s.wrong_hits
            counts.update({f"refused_{reason}": n for reason, n in s.refusals.items()})
        return dict(counts)

    async def lookup(
        self, req: CacheRequest, policy: CachePolicy, request_id: str | None = None
    ) -> CacheHit | None:
        """The cached answer to `req` (see `begin`), without the fence."""
        if not policy.lookup:
            return None
        return (await self.begin(req, policy, request_id)).hit

    async def begin(
        self, req: CacheRequest, policy: CachePolicy, request_id: str | None = None
    ) -> Consulted:
        """The cached answer to `req`, exact first, then semantic (None on a miss, a failure or
        when the policy looks nothing up), and the fence a store of the request's answer
        carries: the purge epochs and the server's incarnation, read in the lookup's first round
        trip (alone when the policy only stores). A hit is recorded under `request_id`, when given (see `report_wrong_hit`).
        """
        if not policy.lookup and not policy.store:
            return Consulted(None, None)
        fence = self.keys.fence(req)  # until read
        if not policy.lookup:
            return Consulted(None, await self._read_fence(fence))
        tenant = self.tenant_stats(req.tenant_id)
        tenant.lookups += 1
        try:
            fence, found, pending = await self._first_read(req, policy, fence)
            if pending is not None:
                found = await self._semantic(req, policy, *pending)
            if found is not None and request_id is not None:
                await self._remember_request(req.tenant_id, request_id, found[1], fence)
        except Exception as exc:
            self._failed("lookup", exc)
            tenant.misses += 1
            return Consulted(None, fence)
        hit = found[0] if found is not None else None
        if hit is None:
            self.stats.misses += 1
            tenant.misses += 1
        elif hit.kind == "exact":
            self.stats.exact_hits += 1
            tenant.exact_hits += 1
        else:
            self.stats.semantic_hits += 1
            tenant.semantic_hits += 1
        return Consulted(hit, fence)

    async def _read_fence(self, fence: Fence) -> Fence:
        """The fence of a request that stores without looking up."""
        try:
            async with asyncio.timeout(self.redis_timeout):
                seen = await self.redis.hmget(fence.key, fence.read)
        except Exception as exc:
            self._failed("lookup", exc)
            return fence
        return _seen(fence, seen)

    async def _first_read(
        self, req: CacheRequest, policy: CachePolicy, fence: Fence
    ) -> tuple[Fence, tuple[CacheHit, str] | None, tuple[str, BucketKeys] | None]:
        """One round trip: the fence, an exact hit with its entry's key, and (on an exact miss
        when the policy allows semantic hits) the question and bucket left to search."""
        key = self.keys.exact(req)
        question = semantic_question(req) if policy.semantic else None
        reads: list[Read] = [("mget", [key], []), ("hmget", [fence.key], fence.read)]
        if question is None:
            async with asyncio.timeout(self.redis_timeout):
                (raw,), seen = await run_reads(self.redis, reads)
            pending = None
        else:
            bucket = self.keys.bucket(req, self.embedder.model_id)
            async with asyncio.timeout(self.redis_timeout):
                # with (core index) the bucket's news
                (raw,), seen = await self.index.prefetch(bucket, also_read=reads)
            pending = (question, bucket)
        if raw is not None:
            hit = CacheHit(decode_response(raw), "exact", None)
            return _seen(fence, seen), (hit, key), None
        return _seen(fence, seen), None, pending

    async def _semantic(
        self, req: CacheRequest, policy: CachePolicy, question: str, bucket: BucketKeys
    ) -> tuple[CacheHit, str] | None:
        """The best verified semantic candidate in the (prefetched) bucket, and its entry's key."""
        # One deadline for the question's embedding and its candidates' word lookups.
        deadline = asyncio.get_running_loop().time() + self.embed_timeout
        try:
            async with asyncio.timeout_at(deadline):
                vector = await self.embedder.embed_whole(question, req.tenant_id)
        except (TimeoutError, Backlogged):
            self._skipped_embedding()
            return None
        if vector is None:
            return None  # longer than the embedder reads: exact hits only
        scope = self.keys.scope(req.tenant_id, req.adapter)
        tenant = self.tenant_stats(req.tenant_id)
        floor = policy.threshold - NEAR_MISS_MARGIN
        async with asyncio.timeout(self.redis_timeout):
            found = await self.index.nearest(bucket, vector, floor, self.candidates)
        above = [c for c in found if c.similarity >= policy.threshold]
        if found and not above:
            tenant.near_misses += 1
        for candidate in above:
            try:
                async with asyncio.timeout_at(deadline):
                    verdict = await self._verify(question, candidate, policy, req.tenant_id)
            except (TimeoutError, Backlogged):
                self._skipped_embedding()
                return None
            if not verdict.accepted:
                self.stats.verifier_rejections += 1
                tenant.refusals[verdict.reason] += 1
                continue
            # A bucket only ever points into its own scope; checked, not assumed.
            if not candidate.response_key.startswith(scope):
                continue
            async with asyncio.timeout(self.redis_timeout):
                raw = await self.index.fetch(bucket, candidate)
            if raw is not None:
                hit = CacheHit(decode_response(raw), "semantic", candidate.similarity)
                return hit, candidate.response_key
        return None

    async def _verify(
        self, question: str, candidate: Candidate, policy: CachePolicy, tenant_id: str
    ) -> Verdict:
        """The verifier's verdict on `candidate`, with `tenant_id`'s word memo."""
        if policy.verifier == "off":
            return Verdict(True, "ok")
        # Words not seen before are encoded off the event loop first; verify only reads them.
        words = [*parse(question).words, *parse(candidate.question).words]
        await self.embedder.learn_words(words, tenant_id)
        # Bounded (`verifier.MAX_CONTENT_WORDS`) but pure Python: on a thread, so one tenant's
        # candidates never hold the event loop that serves every tenant.
        similarity = functools.partial(self.embedder.words.similarity, owner=tenant_id)
        return await asyncio.to_thread(verify, question, candidate.question, similarity)

    async def _remember_request(
        self, tenant_id: str, request_id: str, entry_key: str, fence: Fence
    ) -> None:
        """Record which entry answered the request, for as long as that entry lives (its
        remaining TTL, not the hit's policy's), unless a purge came since its lookup."""
        record = self.keys.request(tenant_id, request_id)
        async with asyncio.timeout(self.redis_timeout):
            done = await self._remember_script(
                keys=[*fence.keys, record, entry_key], args=fence.args()
            )
        if done == 0:
            self.stats.fenced += 1

    async def report_wrong_hit(self, tenant_id: str, request_id: str) -> bool:
        """Invalidate the entry that answered `request_id` of `tenant_id` (so the next identical
        request misses) and count it; False when that tenant has no such request on record.
        Raises on Redis errors (an operator asked for it)."""
        record = self.keys.request(tenant_id, request_id)
        raw = await self.redis.get(record)
        if raw is None:
            return False
        entry_key = raw.decode() if isinstance(raw, bytes) else raw
        # Only ever a key of this tenant's own scope; checked, not assumed.
        if not entry_key.startswith(self.keys.scope(tenant_id)):
            return False
        await self.redis.delete(entry_key, record)
        self.tenant_stats(tenant_id).wrong_hits += 1
        return True

    async def store(
        self,
        req: CacheRequest,
        policy: CachePolicy,
        response: CachedResponse,
        request_id: str | None = None,
        fence: Fence | None = None,
    ) -> None:
        """Keep `response` as the answer to `req` for `policy.ttl` seconds, recorded under
        `request_id` when given, unless a purge came since `fence` was read (`begin`); without
        a fence, only the tenant's deletion refuses it. Never raises."""
        if not policy.store:
            return
        try:
            stored = await self._store(req, policy, response, request_id, fence)
        except Exception as exc:
            self._failed("store", exc)
            return
        if stored:
            self.stats.stores += 1
        else:
            self.stats.fenced += 1

    async def _store(
        self,
        req: CacheRequest,
        policy: CachePolicy,
        response: CachedResponse,
        request_id: str | None,
        fence: Fence | None,
    ) -> bool:
        """The entry, then the request's record of it, in one script (a response waits for
        it; a record never points at an entry Redis refused, out of memory), then the semantic
        index's entry, each checked against the fence; False when the fence refused them."""
        fence = fence or self.keys.fence(req)
        key = self.keys.exact(req)
        keys = [*fence.keys, key]
        if request_id is not None:
            keys.append(self.keys.request(req.tenant_id, request_id))
        async with asyncio.timeout(self.redis_timeout):
            stored = await self._store_script(
                keys=keys, args=[*fence.args(), encode_response(response), policy.ttl]
            )
        question = semantic_question(req)
        if not stored or not policy.semantic or question is None:
            return bool(stored)
        try:
            vector = await self.embedder.embed_whole(question, req.tenant_id)
        except Backlogged:
            self._skipped_embedding()
            return True  # the exact entry only
        if vector is None:
            return True  # longer than the embedder reads: its tail would not be compared
        bucket = self.keys.bucket(req, self.embedder.model_id)
        async with asyncio.timeout(self.redis_timeout):
            return await self.index.add(bucket, vector, question, key, policy.ttl, fence)

    def store_in_background(
        self,
        req: CacheRequest,
        policy: CachePolicy,
        response: CachedResponse,
        request_id: str | None = None,
        fence: Fence | None = None,
    ) -> None:
        """`store` without waiting for it (the response need not wait for the embedder)."""
        if not policy.store:
            return
        stored = self.store(req, policy, response, request_id, fence)
        task = asyncio.get_running_loop().create_task(stored)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for background stores (at shutdown, and in tests)."""
        while self._background:
            await asyncio.gather(*self._background)

    async def purge(
        self, tenant_id: str, adapter: str | None = None, *, tenant_deleted: bool = False
    ) -> int:
        """Delete a tenant's entries (of one adapter digest, or "base", when given); returns the
        number of responses removed (`cache.purge.purge_scope`). Raises on Redis errors (an
        operator asked for it)."""
        return await purge_scope(
            self.redis, self.keys, self._purge_epoch, tenant_id, adapter, tenant_deleted
        )

    def _skipped_embedding(self) -> None:
        """Count a lookup or store that went without its embedding (deadline, backlog)."""
        self.stats.embed_skipped += 1
        self.stats.errors += 1

    def _failed(self, operation: str, exc: Exception) -> None:
        self.stats.errors += 1
        now = time.monotonic()
        if now - self._last_log.get(operation, -self.log_every) >= self.log_every:
            self._last_log[operation] = now
            log.warning(
                "response cache %s failed (%s: %s); serving uncached",
                operation,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, (OSError, TimeoutError, redis.RedisError)),
            )


def _seen(fence: Fence, seen: Sequence[bytes | str | None]) -> Fence:
    """`fence` with its fields' values as HMGET read them (None: never purged, no incarnation)."""
    tenant, adapter, boot = (v.decode() if isinstance(v, bytes) else v or "" for v in seen)
    return dataclasses.replace(fence, seen=(tenant, adapter, boot))
