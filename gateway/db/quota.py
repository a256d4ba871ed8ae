from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from loramux.gateway.db.base import Base, new_id


class Quota(Base):
    """Limits of a tenant (key_id None) or of one of its keys; a None field is no limit.

    At most one row per tenant and one per key: the unique constraint covers key rows (SQL's
    NULLs are all distinct), the partial unique index the tenant's own row."""

    __tablename__ = "quotas"
    __table_args__ = (
        UniqueConstraint("tenant_id", "key_id"),
        Index(
            "uq_quotas_tenant_level",
            "tenant_id",
            unique=True,
            sqlite_where=text("key_id IS NULL"),
            postgresql_where=text("key_id IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("quo"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_id: Mapped[str | None] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), nullable=True
    )
    rpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_concurrent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    token_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    budget_period: Mapped[str | None] = mapped_column(String(8), nullable=True)
    """`day` or `month`."""
