from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Float, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from loramux.gateway.db.base import Base, utcnow
from loramux.gateway.setting_checks import MAX_USAGE_MODEL


def new_event_id() -> str:
    """An id no other usage event has: 32 hex digits."""
    return uuid.uuid4().hex


class UsageEvent(Base):
    """One finished request (append-only)."""

    __tablename__ = "usage_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, index=True
    )
    event_id: Mapped[str | None] = mapped_column(
        String(32), unique=True, index=True, nullable=True, default=new_event_id
    )
    """Given when the event was recorded (`UsageRecord.event_id`): a write tried again after
    its commit's reply was lost stores nothing twice. Rows stored before it existed hold
    `legacy_<id>`; rows a gateway of the previous release writes during a rolling upgrade hold
    NULL (distinct in the unique index), which is why the column is nullable: a later release
    may make it NOT NULL once no such gateway writes."""
    request_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str] = mapped_column(String(32), index=True)
    key_id: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(MAX_USAGE_MODEL))
    """The model that answered, however the request named it: the adapter's name (`shared/…`
    for a shared one) or the base model's id (`ResolvedModel.billed_as`); empty when the request
    was refused before its model was resolved. Rows written by earlier releases hold the name
    as the request wrote it."""
    adapter_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cache: Mapped[str] = mapped_column(String(16), default="miss")
    status: Mapped[int] = mapped_column(Integer)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)
    ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    refusal: Mapped[str | None] = mapped_column(String(16), nullable=True)
    """For a 429, the limit that refused the request: requests, tokens, concurrency, budget,
    backlog."""
    admitted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    """When the request was admitted: a token budget counts the event in the period holding
    this time (`created_at` when null), the period its reservation was charged in."""
