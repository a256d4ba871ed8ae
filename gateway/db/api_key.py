from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from loramux.gateway.db.base import Base, Timestamped


class ApiKey(Timestamped, Base):
    """A tenant API key `lmx-<id>.<secret>`: only a hash of the secret is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str | None] = mapped_column(String(200), nullable=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    """sha256 hex of the secret (the secret is 32 random bytes, so no slow hash is needed)."""
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    """Model names this key may call; None means every model its tenant may use."""
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    @property
    def prefix(self) -> str:
        return f"lmx-{self.id}"
