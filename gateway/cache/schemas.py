"""Wire shapes of the cache routes."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from gateway.cache_policy import MAX_TTL

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


class CacheSettingsOut(Struct):
    tenant_id: str
    enabled: bool
    semantic: bool
    threshold: float
    verifier: str
    ttl: int
    cache_sampled: bool


class Purged(Struct):
    purged: int
    """Cached responses removed."""
