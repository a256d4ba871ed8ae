"""Wire shapes of `/admin/audit`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from msgspec import Struct


class AuditOut(Struct):
    id: int
    created_at: datetime
    actor: str
    """The admin token's subject, `anonymous` for a refused token, or e.g. `first-start`."""
    action: str
    target: str | None
    outcome: str
    """`ok`, or the error's code."""
    detail: dict[str, Any]


class AuditPage(Struct):
    items: list[AuditOut]
    total: int
    """Entries the filter matches, on every page."""
    limit: int
    offset: int
