from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Boolean, String
from sqlalchemy.orm import Mapped, mapped_column

from loramux.gateway.db.base import Base, Timestamped, new_id

TENANT_ID_PREFIX = "tnt_"

MAX_TENANT_NAME = 200
"""The most characters a tenant's name may hold (its column)."""


class Tenant(Timestamped, Base):
    """A customer of the platform: owns API keys, private adapters, quotas and usage."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(
        String(32), primary_key=True, default=lambda: new_id(TENANT_ID_PREFIX[:-1])
    )
    name: Mapped[str] = mapped_column(String(MAX_TENANT_NAME), unique=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    settings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Per-tenant options (response-cache policy, default max tokens, …)."""
