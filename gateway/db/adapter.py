from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from loramux.gateway.db.base import Base, Timestamped, new_id

SHARED_OWNER = "shared"
"""Owner of adapters every tenant may use."""

MAX_ADAPTER_NAME = 100
"""The most characters an adapter's name may hold (its column; uploads allow 64)."""


class AdapterVersion(Timestamped, Base):
    """One uploaded version of an adapter `owner/name`; the highest live version serves."""

    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("owner", "name", "version"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("adp"))
    owner: Mapped[str] = mapped_column(String(32), index=True)
    """A tenant id, or `shared`."""
    name: Mapped[str] = mapped_column(String(MAX_ADAPTER_NAME))
    version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    targets: Mapped[list[str]] = mapped_column(JSON, default=list)
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
