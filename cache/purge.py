"""Purging a tenant's cached responses, or one adapter's of them.

A purge is final for what came before it. A request's lookup (`begin`) reads the purge epochs
of its tenant and adapter scopes in the same round trip, and every write its answer makes (the
entry, the request record, the semantic index's entry) carries them as a `Fence` into the one
script that writes, which refuses it when a purge of either scope ran since. A purge first moves
its scope's epoch, then deletes what its SCAN finds: an answer made before the purge is either
deleted by it or never written. Deleting a tenant leaves a tombstone for its epoch (kept for the
longest entry lifetime, `MAX_TTL`) that refuses every write of that tenant, including those of a
gateway process that still authenticates its keys for a moment. The cache Redis keeps no data
across a restart and may evict any key, so the epochs and tombstones are fields of the hash
that holds the server's incarnation id (`Keyspace.incarnation`), lost with it, and the fence
also carries that id (read in the same round trip): a write whose lookup read another
incarnation, or none, is refused, and neither a restart nor an eviction between a lookup and
its store can undo a purge. A store whose lookup failed has no fence; only a tombstone refuses it (see `Fence`).

A tenant's delete commits before its purge, so a purge the cache Redis does not answer is
retried in the background (`DeletedTenantPurges`) until it does. If the process stops first,
the entries are left to expire (`MAX_TTL` at most), never served: the tenant's keys went with
its row, and tenant ids are random (`db.base.new_id`), never given to another tenant.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

import redis.asyncio
from redis.commands.core import AsyncScript

from loramux.cache.keys import Keyspace, glob_escape
from loramux.cache.types import MAX_TTL

log = logging.getLogger(__name__)

RETRY_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""The waits before each retry of a deleted tenant's purge; the last one repeats."""


async def purge_scope(
    client: redis.asyncio.Redis,
    keys: Keyspace,
    purge_epoch: AsyncScript,
    tenant_id: str,
    adapter: str | None,
    tenant_deleted: bool,
) -> int:
    """Delete a tenant's entries (of one adapter digest, or "base", when given); returns the
    number of responses removed. The scope's purge epoch moves first (`purge_epoch`, the
    PURGE_EPOCH script), so no request whose lookup came before the purge writes after it;
    `tenant_deleted` makes the tenant's epoch a tombstone that refuses every later write of the
    tenant. Raises on Redis errors."""
    if tenant_deleted and adapter is not None:
        raise ValueError("a deleted tenant is purged whole")
    epoch = ("gone:" if tenant_deleted else "") + secrets.token_hex(8)
    epoch_keys, args = [keys.incarnation], [keys.epoch(tenant_id, adapter), epoch, str(MAX_TTL)]
    try:
        await purge_epoch(keys=epoch_keys, args=args)
    except redis.exceptions.ConnectionError:
        # Once more, on a new connection: a pooled one a Redis restart closed fails once,
        # and a tenant's delete, committed by then, answered 500 with its cache unpurged.
        # Moving the epoch again is harmless.
        await purge_epoch(keys=epoch_keys, args=args)
    pattern = glob_escape(keys.scope(tenant_id, adapter)) + "*"
    removed = 0
    batch: list[bytes] = []
    async for key in client.scan_iter(match=pattern, count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            removed += await _unlink(client, batch)
            batch = []
    if batch:
        removed += await _unlink(client, batch)
    return removed


async def _unlink(client: redis.asyncio.Redis, batch: list[bytes]) -> int:
    """Unlink `batch`; how many of them were response entries."""
    await client.unlink(*batch)
    return sum(Keyspace.is_exact(k.decode()) for k in batch)


class DeletedTenantPurges:
    """Deleted tenants' purges (with their tombstones), retried in the background while the
    cache Redis does not answer, until they succeed or `MAX_TTL` has passed (every entry they
    would remove has expired by then). `purge` is the purge of one deleted tenant."""

    def __init__(self, purge: Callable[[str], Awaitable[int]]) -> None:
        self._purge = purge
        self._retrying: dict[str, asyncio.Task[None]] = {}

    @property
    def pending(self) -> frozenset[str]:
        """The deleted tenants whose purge is still to be retried."""
        return frozenset(self._retrying)

    async def purge(self, tenant_id: str) -> int | None:
        """The deleted tenant's entries removed, or None when the cache Redis failed: then the
        purge is retried in the background."""
        try:
            return await self._purge(tenant_id)
        except Exception as exc:
            log.warning(
                "the response cache of deleted tenant %s could not be purged (%s: %s); "
                "retrying in the background",
                tenant_id,
                type(exc).__name__,
                exc,
            )
            if tenant_id not in self._retrying:
                task = asyncio.create_task(self._retry(tenant_id))
                self._retrying[tenant_id] = task
                task.add_done_callback(lambda _: self._retrying.pop(tenant_id, None))
            return None

    async def _retry(self, tenant_id: str) -> None:
        """Purge the tenant once the cache Redis answers again."""
        give_up = time.monotonic() + MAX_TTL
        attempt = 0
        while time.monotonic() < give_up:
            await asyncio.sleep(RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)])
            attempt += 1
            try:
                removed = await self._purge(tenant_id)
            except Exception:
                continue
            log.info("purged %d cached responses of deleted tenant %s", removed, tenant_id)
            return
        log.warning("gave up purging deleted tenant %s: its entries have expired", tenant_id)

    def cancel(self) -> None:
        """Stop retrying (at shutdown): what is left expires with its entries' TTL."""
        for task in self._retrying.values():
            task.cancel()
