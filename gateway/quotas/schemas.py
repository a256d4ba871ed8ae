"""Wire shapes of the quota routes."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from loramux.gateway.admin.wire import INT32_MAX, INT64_MAX

PositiveInt32 = Annotated[int, Meta(ge=1, le=INT32_MAX)]
PositiveInt64 = Annotated[int, Meta(ge=1, le=INT64_MAX)]
BudgetPeriod = Literal["day", "month"]


class QuotaUpdate(Struct, forbid_unknown_fields=True):
    """Absent: leave the limit as it is; null: remove it. A token budget needs a period."""

    rpm: PositiveInt32 | UnsetType | None = UNSET
    """Requests per minute."""
    tpm: PositiveInt32 | UnsetType | None = UNSET
    """Tokens (prompt and completion) per minute."""
    max_concurrent: PositiveInt32 | UnsetType | None = UNSET
    """Requests in flight at once."""
    token_budget: PositiveInt64 | UnsetType | None = UNSET
    """Tokens per `budget_period`."""
    budget_period: BudgetPeriod | UnsetType | None = UNSET


class QuotaOut(Struct):
    """Limits of a tenant (`key_id` null) or of one key; null means no limit."""

    tenant_id: str
    key_id: str | None
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    token_budget: int | None
    budget_period: str | None
