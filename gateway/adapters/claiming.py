"""Waiting for a claim on an adapter digest (adapters.claims) on the event loop: retried with
a growing pause, never by a thread blocked on the lock (a thread waiting there would hold a
thread of the pool that a cleanup needs to finish: enough uploads of the same bytes deadlocked
the worker)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from loramux.adapters.claims import Claim, DigestClaims

CLAIM_RETRY_SECONDS = 0.005
"""The first pause before a claim is tried again (doubling, to 0.2 s)."""


async def claim(claims: DigestClaims, digest: str) -> Claim:
    """A publish's claim on `digest`, once no cleanup of it is deciding."""
    return await _retried(lambda: claims.try_claim(digest))


async def cleanup_turn(claims: DigestClaims, digest: str) -> Claim:
    """A cleanup's turn on `digest`, once any other cleanup of it has ended."""
    return await _retried(lambda: claims.try_cleanup(digest))


async def _retried(take: Callable[[], Claim | None]) -> Claim:
    pause = CLAIM_RETRY_SECONDS
    while (held := take()) is None:
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.2)
    return held
