"""Per-tenant counters of the response cache's decisions, kept by each process since it started.

They are what a tenant's threshold is tuned from: how often lookups hit, how often a semantic
lookup just missed (its best candidate fell short of the threshold by less than
`NEAR_MISS_MARGIN`), which verifier checks refused candidates, and how many hits an admin
reported as wrong (`ResponseCache.report_wrong_hit`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

NEAR_MISS_MARGIN = 0.05
"""A missed semantic lookup whose best candidate was this close below the threshold is a near
miss: many near misses suggest the threshold is too high for the tenant's questions."""


@dataclass
class TenantCacheStats:
    lookups: int = 0
    exact_hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    near_misses: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    """Candidates above the threshold refused by the verifier, by the check that refused them."""
    wrong_hits: int = 0
    """Entries invalidated because an admin reported the response served from them as wrong."""

    @property
    def hit_rate(self) -> float:
        return (self.exact_hits + self.semantic_hits) / self.lookups if self.lookups else 0.0

    @property
    def near_miss_rate(self) -> float:
        return self.near_misses / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "lookups": self.lookups,
            "exact_hits": self.exact_hits,
            "semantic_hits": self.semantic_hits,
            "misses": self.misses,
            "near_misses": self.near_misses,
            "hit_rate": self.hit_rate,
            "near_miss_rate": self.near_miss_rate,
            "refusals": dict(sorted(self.refusals.items())),
            "wrong_hits": self.wrong_hits,
        }


@dataclass
class CacheStats:
    """Counters since the process started."""

    exact_hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    verifier_rejections: int = 0
    """Candidates above the similarity threshold that the verifier refused."""
    stores: int = 0
    fenced: int = 0
    """Writes refused because a purge (or the tenant's deletion) came after their lookup."""
    errors: int = 0
    """Lookups and stores that failed (Redis or embedder) and were served as misses / dropped."""
    embed_skipped: int = 0
    """Lookups and stores that went without the embedding of their question: its deadline
    passed, or the tenant had `Embedder.max_waiting` texts waiting (also in `errors`)."""
