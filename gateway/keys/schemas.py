"""Wire shapes of the API-key routes."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from msgspec import Meta, Struct

from loramux.gateway.admin.wire import DisplayName, ModelName


class KeyCreate(Struct, forbid_unknown_fields=True):
    """`expires_at` (ISO time; naive means UTC) or `expires_in` (seconds), not both."""

    name: DisplayName | None = None
    expires_at: datetime | None = None
    expires_in: Annotated[int, Meta(ge=1, le=10 * 365 * 86400)] | None = None
    allowed_models: Annotated[list[ModelName], Meta(max_length=1000)] | None = None
    """Model names the key may call; absent or null: every model its tenant may use."""


class KeyOut(Struct):
    id: str
    tenant_id: str
    prefix: str
    name: str | None
    allowed_models: list[str] | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class KeyPage(Struct):
    items: list[KeyOut]
    total: int
    """Keys the filter matches, on every page."""
    limit: int
    offset: int


class NewKeyOut(KeyOut):
    key: str
    """The full secret key; it is shown here once and never again."""
