"""How a streamed cache hit is sent: at once, or paced like a generation.

A hit is ready in full, so by default it goes out at once (`instant`: one piece). A tenant whose
clients should not be able to tell a cached answer from a fresh one by its timing — or whose UI
expects text to arrive at reading speed — sets `paced`: the text is cut into as many pieces as
it had completion tokens, each sent `1 / tokens_per_second` after the one before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Literal

HitPacing = Literal["instant", "paced"]


@dataclass(frozen=True)
class Pacing:
    mode: HitPacing = "instant"
    tokens_per_second: float = 30.0
    """Pieces per second when paced (one piece per completion token)."""

    def __post_init__(self) -> None:
        if not 0 < self.tokens_per_second <= 10_000:
            raise ValueError("tokens_per_second must be above 0 and at most 10000")


def hit_pieces(text: str, completion_tokens: int, pacing: Pacing) -> Iterator[tuple[str, float]]:
    """(piece, delay before sending it) pairs whose pieces concatenate to `text`.

    Paced pieces are cut at equal character counts (the cache keeps text, not token offsets);
    the first goes at once, as a fresh generation's first token would after the prefill."""
    if pacing.mode == "instant" or completion_tokens <= 1 or len(text) <= 1:
        yield text, 0.0
        return
    pieces = min(completion_tokens, len(text))
    gap = 1.0 / pacing.tokens_per_second
    bounds = [round(i * len(text) / pieces) for i in range(pieces + 1)]
    for i in range(pieces):
        yield text[bounds[i] : bounds[i + 1]], 0.0 if i == 0 else gap


async def paced_hit(text: str, completion_tokens: int, pacing: Pacing) -> AsyncIterator[str]:
    """`hit_pieces`, each piece yielded after its delay."""
    for piece, delay in hit_pieces(text, completion_tokens, pacing):
        if delay:
            await asyncio.sleep(delay)
        yield piece
