"""Purging a tenant's cached responses, or one adapter's of them.

A purge is final for what came before it. A request's lookup (`begin`) reads the purge epochs
of its tenant and adapter scopes in the same round trip, and every write its answer makes (the
entry, the request record, the semantic index's entry) carries them as a `Fence` into the one
script that writes, which refuses it when a purge of either scope ran since. A purge first moves
its scope's epoch, then deletes what its SCAN finds: an answer made before the purge is either
deleted by it or never written. Deleting a tenant leaves a tombstone for its epoch (kept for the
longest entry lifetime, `MAX_TTL`) that refuses every write of that tenant, including those of a
gateway process that still authenticates its keys for a moment. The cache Redis keeps no data
across a restart, epochs and tombstones included, so the fence also carries the server's
incarnation (`Keyspace.boot`, read in the same round trip): a write whose lookup read another
incarnation, or none, is refused, and a restart between a lookup and its store cannot undo a
purge. A store whose lookup failed has no fence; only a tombstone refuses it (see `Fence`).
"""

from __future__ import annotations

import secrets

import redis.asyncio
from redis.commands.core import AsyncScript

from loramux.cache.keys import Keyspace, glob_escape
from loramux.cache.types import MAX_TTL


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
    epoch_keys, args = [keys.epoch(tenant_id, adapter)], [epoch, str(MAX_TTL)]
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
