"""What a tenant or key is using right now, read from the limiter's own Redis buckets: requests
and tokens admitted in the last minute (the sliding window RPM and TPM count against) and
concurrency slots held. Buckets exist only for limits that are set (`gateway.quotas.buckets`),
so a scope without a limit reads as 0 there.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from loramux.gateway.quotas.buckets import WINDOW_MS, scope_prefix


@dataclass(frozen=True)
class LiveUse:
    requests: int
    """Admitted in the last minute (what `rpm` counts)."""
    tokens: int
    """Counted in the last minute (what `tpm` counts; reservations until they settle)."""
    in_flight: int
    """Concurrency slots held now (what `max_concurrent` counts)."""


async def live_use(redis: Redis, tenant_id: str, key_id: str | None) -> LiveUse:
    """One scope's use now, on Redis's clock (the limiter's clock)."""
    prefix = scope_prefix(tenant_id, key_id)
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros // 1000
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrangebyscore(f"{prefix}:win", f"({now_ms - WINDOW_MS}", "+inf")
        pipe.zcount(f"{prefix}:conc", f"({now_ms}", "+inf")
        members, in_flight = await pipe.execute()
    tokens = 0
    if members:
        counted = await redis.hmget(f"{prefix}:wtok", members)
        tokens = sum(int(t) for t in counted if t is not None)
    return LiveUse(len(members), tokens, int(in_flight))
