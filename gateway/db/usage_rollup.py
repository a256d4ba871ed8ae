"""Hourly and daily usage rollups: one row per (bucket, tenant, key, model), kept up to date with
`usage_events` in the same transaction that appends the events (see `gateway.usage`).

A bucket is the UTC start of its hour or day. Every measure is additive, so rows from any mix of
buckets merge by plain addition, and so do their latency histograms: bin `i` counts the requests
whose latency (or time to first token) was in `(BOUNDS_MS[i-1], BOUNDS_MS[i]]`, the last bin those
above `BOUNDS_MS[-1]`. Percentiles are read from those bins (`UsageTotals.latency_percentile`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import BigInteger, Column, DateTime, Float, PrimaryKeyConstraint, String, Table

from loramux.gateway.db.base import Base
from loramux.gateway.setting_checks import MAX_USAGE_MODEL

BOUNDS_MS: tuple[float, ...] = (
    5, 10, 20, 50, 100, 200, 350, 500, 750, 1000, 1500, 2000, 3000, 5000, 10000, 20000, 60000,
)  # fmt: skip
"""Upper edges of the histogram bins (milliseconds); one more bin holds everything above."""
BINS = len(BOUNDS_MS) + 1
CLIENT_CLOSED = 499
"""The status recorded for a request whose client left before the end (nginx's)."""

REFUSALS = (
    "refused_requests",
    "refused_tokens",
    "refused_concurrency",
    "refused_budget",
    "refused_backlog",
)
"""429s by the limit that refused them: requests or tokens per minute, concurrency, budget, or
the tenant's bound of prompts waiting for the gateway's tokenizer (`backlog`)."""
OUTCOMES = ("aborts", *REFUSALS, "client_errors", "server_errors")
"""`aborts`: the client left before the end (499); `refused_*`: a quota refused it (429);
`client_errors`: any other 4xx (a bad body, an unknown model, …); `server_errors`: 5xx."""
COUNTERS = (
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "exact_hits",
    "semantic_hits",
    "ttft_count",
    *OUTCOMES,
)
"""Integer measures. `errors`: status 400 or more, whatever the cause; `*_hits`: answered by that
response cache; `ttft_count`: requests that reported a time to first token; `OUTCOMES`: the
requests that did not succeed, each counted in exactly one of them."""
SUMS = ("latency_ms_sum", "ttft_ms_sum")
LATENCY_BINS = tuple(f"latency_bin{i:02d}" for i in range(BINS))
TTFT_BINS = tuple(f"ttft_bin{i:02d}" for i in range(BINS))
MEASURES = COUNTERS + SUMS + LATENCY_BINS + TTFT_BINS
"""Every additive column of a rollup row, in the order `UsageTotals` reads and writes them."""
GROUP_KEY = ("tenant_id", "bucket", "key_id", "model")
"""The primary key; tenant first, since reads filter by tenant, then by time."""


def _rollup_table(name: str) -> Table:
    integer = BigInteger()
    return Table(
        name,
        Base.metadata,
        Column("bucket", DateTime(timezone=True), nullable=False, index=True),
        Column("tenant_id", String(32), nullable=False),
        Column("key_id", String(32), nullable=False),
        Column("model", String(MAX_USAGE_MODEL), nullable=False),
        *(Column(c, integer, nullable=False, default=0) for c in COUNTERS),
        *(Column(c, Float(), nullable=False, default=0.0) for c in SUMS),
        *(Column(c, integer, nullable=False, default=0) for c in LATENCY_BINS + TTFT_BINS),
        PrimaryKeyConstraint(*GROUP_KEY),
    )


usage_hourly = _rollup_table("usage_hourly")
usage_daily = _rollup_table("usage_daily")


def histogram_bin(value_ms: float) -> int:
    """The bin of a latency: the first `i` with `value_ms <= BOUNDS_MS[i]`, else the last bin."""
    return bisect.bisect_left(BOUNDS_MS, value_ms)


@dataclass
class UsageTotals:
    """The measures of any set of requests: one rollup row, or many merged."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    exact_hits: int = 0
    semantic_hits: int = 0
    ttft_count: int = 0
    aborts: int = 0
    refused_requests: int = 0
    refused_tokens: int = 0
    refused_concurrency: int = 0
    refused_budget: int = 0
    refused_backlog: int = 0
    client_errors: int = 0
    server_errors: int = 0
    latency_ms_sum: float = 0.0
    ttft_ms_sum: float = 0.0
    latency_bins: list[int] = field(default_factory=lambda: [0] * BINS)
    ttft_bins: list[int] = field(default_factory=lambda: [0] * BINS)

    @classmethod
    def from_values(cls, values: Sequence[Any]) -> UsageTotals:
        """From values in `MEASURES` order (SQL sums may come back as Decimal or None)."""
        assert len(values) == len(MEASURES), "values must follow MEASURES"
        named = dict(zip(MEASURES, values, strict=True))
        scalars: dict[str, Any] = {c: int(named[c] or 0) for c in COUNTERS}
        scalars |= {c: float(named[c] or 0.0) for c in SUMS}
        return cls(
            **scalars,
            latency_bins=[int(named[c] or 0) for c in LATENCY_BINS],
            ttft_bins=[int(named[c] or 0) for c in TTFT_BINS],
        )

    def values(self) -> dict[str, int | float]:
        """The measures as rollup columns."""
        scalars = {name: getattr(self, name) for name in COUNTERS + SUMS}
        return (
            scalars
            | dict(zip(LATENCY_BINS, self.latency_bins, strict=True))
            | dict(zip(TTFT_BINS, self.ttft_bins, strict=True))
        )

    def add(self, other: UsageTotals) -> None:
        for name in COUNTERS + SUMS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.latency_bins = [
            a + b for a, b in zip(self.latency_bins, other.latency_bins, strict=True)
        ]
        self.ttft_bins = [a + b for a, b in zip(self.ttft_bins, other.ttft_bins, strict=True)]

    @property
    def refusals(self) -> int:
        return sum(getattr(self, name) for name in REFUSALS)

    def count_outcome(self, status: int, refusal: str | None) -> None:
        """Count one request's outcome: its status and, for a 429, the limit that refused it."""
        self.requests += 1
        if status < 400:
            return
        self.errors += 1
        if status == CLIENT_CLOSED:
            self.aborts += 1
        elif status == 429:
            reason = f"refused_{refusal}"
            name = reason if reason in REFUSALS else "refused_requests"
            setattr(self, name, getattr(self, name) + 1)
        elif status >= 500:
            self.server_errors += 1
        else:
            self.client_errors += 1

    @property
    def cache_hits(self) -> int:
        return self.exact_hits + self.semantic_hits

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cache_hit_rate(self) -> float | None:
        return self.cache_hits / self.requests if self.requests else None

    @property
    def mean_latency_ms(self) -> float:
        return self.latency_ms_sum / self.requests if self.requests else 0.0

    @property
    def mean_ttft_ms(self) -> float | None:
        return self.ttft_ms_sum / self.ttft_count if self.ttft_count else None

    def latency_percentile(self, q: float) -> float | None:
        return percentile(self.latency_bins, q)

    def ttft_percentile(self, q: float) -> float | None:
        return percentile(self.ttft_bins, q)


def percentile(bins: Sequence[int], q: float) -> float | None:
    """The `q`-quantile (0 < q <= 1) of a histogram, interpolated linearly inside its bin; within
    one bin's width of the truth. None when empty; the last bin answers with its lower edge."""
    total = sum(bins)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(bins):
        if count and seen + count >= rank:
            if i == len(BOUNDS_MS):
                return float(BOUNDS_MS[-1])
            low = BOUNDS_MS[i - 1] if i else 0.0
            return low + (BOUNDS_MS[i] - low) * max(rank - seen, 0.0) / count
        seen += count
    return float(BOUNDS_MS[-1])
