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
    """Requests answered with a status of 400 or more: the sum of the five below."""
    aborts: int
    """The client left before the end (499)."""
    refusals: dict[str, int]
    """429s by the limit that refused them: `requests`, `tokens`, `concurrency`, `budget`,
    `backlog` (the tenant's bound of prompts waiting to be tokenized)."""
    client_errors: int
    """Other 4xx: a bad body, an unknown model, a model the key may not use, …"""
    server_errors: int
    """5xx: the engine or a backing service failed."""
    mean_latency_ms: float


class UsageReport(Struct):
    group_by: str
    tenant: str | None
    start: datetime | None = msgspec.field(name="from")
    end: datetime | None = msgspec.field(name="to")
    rows: list[UsageRow] = msgspec.field(default_factory=list)
