"""Wire shapes of the cache routes."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from loramux.gateway.cache_policy import MAX_TTL

Threshold = Annotated[float, Meta(ge=0.5, le=1.0)]
Ttl = Annotated[int, Meta(ge=1, le=MAX_TTL)]


class CacheSettingsUpdate(Struct, forbid_unknown_fields=True):
    """Absent fields keep their value."""

    enabled: bool | UnsetType = UNSET
    semantic: bool | UnsetType = UNSET
    """Semantic hits need this; they are never served to sampled requests."""
    threshold: Threshold | UnsetType = UNSET
    """Cosine similarity a semantic hit needs."""
    verifier: Literal["strict", "off"] | UnsetType = UNSET
    ttl: Ttl | UnsetType = UNSET
    """Seconds a cached response lives."""
    cache_sampled: bool | UnsetType = UNSET
    hit_pacing: Literal["instant", "paced"] | UnsetType = UNSET
    """How a streamed hit is sent: at once, or one piece per token at `hit_tokens_per_second`."""
    hit_tokens_per_second: Annotated[float, Meta(gt=0, le=10_000)] | UnsetType = UNSET


class CacheSettingsOut(Struct):
    tenant_id: str
    enabled: bool
    semantic: bool
    threshold: float
    verifier: str
    ttl: int
    cache_sampled: bool
    hit_pacing: str
    hit_tokens_per_second: float


class Purged(Struct):
    purged: int
    """Cached responses removed."""


class WrongHit(Struct, forbid_unknown_fields=True):
    """A response an admin reports as wrong: its tenant and its `id` (`chatcmpl-…`, `cmpl-…`),
    or the `x-request-id` it was sent with when its client sent none (the gateway's `req_…`)."""

    tenant: Annotated[str, Meta(min_length=1, max_length=200)]
    request_id: Annotated[str, Meta(min_length=1, max_length=200)]


class WrongHitOut(Struct):
    invalidated: bool
    """Always true: an unknown request (or another tenant's) is a 404."""


class LabelledPair(Struct, forbid_unknown_fields=True):
    """`a` is the question in the cache, `b` the one asked; `same`: `a`'s answer answers `b`."""

    a: Annotated[str, Meta(min_length=1, max_length=1000)]
    b: Annotated[str, Meta(min_length=1, max_length=1000)]
    same: bool


class ThresholdTuning(Struct, forbid_unknown_fields=True):
    pairs: Annotated[list[LabelledPair], Meta(min_length=2, max_length=2000)]
    objective: Literal["f1", "precision"] = "precision"
    """`f1`, or `precision`: the most recall with precision at least `min_precision`."""
    min_precision: Annotated[float, Meta(ge=0.5, le=1.0)] = 0.98


class ThresholdTuned(Struct):
    threshold: float
    """Now the tenant's threshold."""
    precision: float
    recall: float
    f1: float
    pairs: int


class CacheStatsOut(Struct):
    """This gateway process's counts since it started (each worker keeps its own)."""

    tenant_id: str
    lookups: int
    exact_hits: int
    semantic_hits: int
    misses: int
    near_misses: int
    hit_rate: float
    near_miss_rate: float
    refusals: dict[str, int]
    """Candidates above the threshold that the verifier refused, by check."""
    wrong_hits: int
    """Entries invalidated by `POST /admin/cache/feedback`."""
