"""Wire shapes of `/admin/usage`."""

from __future__ import annotations

from datetime import datetime

import msgspec
from msgspec import Struct


class UsageRow(Struct):
    group: str
    """The day (YYYY-MM-DD, UTC), the model name, or the key id."""
    tenant_id: str | None
    """Set when grouping by adapter or key (both are per tenant)."""
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_hits: int
    errors: int
    mean_latency_ms: float


class UsageReport(Struct):
    group_by: str
    tenant: str | None
    start: datetime | None = msgspec.field(name="from")
    end: datetime | None = msgspec.field(name="to")
    rows: list[UsageRow] = msgspec.field(default_factory=list)
