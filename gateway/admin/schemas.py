"""Wire shapes of the admin API (msgspec) and the one way request bodies are decoded.

Request bodies are decoded inside each action (not by the framework) so that a malformed body
is an audited failure of that action like any other. Unknown fields are refused, so a typo
(`"rmp": 10`) is a 400, not a silent no-op. Fields that may be left out of a PATCH-like body are
`UNSET` when absent, which keeps "absent" (leave as it is) apart from `null` (remove).
"""

from __future__ import annotations

import re
import unicodedata
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from litestar import Request
from msgspec import UNSET, Meta, Struct, UnsetType

from gateway.errors import BadRequest
from gateway.prefix_cache import PrefixCacheScope

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

TenantName = Annotated[str, Meta(min_length=1, max_length=200)]
"""Also held to `check_display_name`."""
KeyName = Annotated[str, Meta(min_length=1, max_length=200)]
"""Also held to `check_display_name`."""
ModelName = Annotated[str, Meta(min_length=1, max_length=200)]
PositiveInt32 = Annotated[int, Meta(ge=1, le=INT32_MAX)]
PositiveInt64 = Annotated[int, Meta(ge=1, le=INT64_MAX)]
BudgetPeriod = Literal["day", "month"]


class TenantCreate(Struct, forbid_unknown_fields=True):
    name: TenantName
    prefix_cache_scope: PrefixCacheScope = "tenant"
    """`tenant`: no other tenant's prompts are reused from the prefix cache; `shared`: prompts
    are reused between every tenant in the shared scope (see gateway.prefix_cache)."""


class TenantUpdate(Struct, forbid_unknown_fields=True):
    name: TenantName | UnsetType = UNSET
    disabled: bool | UnsetType = UNSET
    prefix_cache_scope: PrefixCacheScope | UnsetType = UNSET


class TenantOut(Struct):
    id: str
    name: str
    disabled: bool
    created_at: datetime
    prefix_cache_scope: PrefixCacheScope


class KeyCreate(Struct, forbid_unknown_fields=True):
    """`expires_at` (ISO time; naive means UTC) or `expires_in` (seconds), not both."""

    name: KeyName | None = None
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


class NewKeyOut(KeyOut):
    key: str
    """The full secret key; it is shown here once and never again."""


class QuotaUpdate(Struct, forbid_unknown_fields=True):
    """Absent: leave the limit as it is; null: remove it."""

    rpm: PositiveInt32 | UnsetType | None = UNSET
    tpm: PositiveInt32 | UnsetType | None = UNSET
    max_concurrent: PositiveInt32 | UnsetType | None = UNSET
    token_budget: PositiveInt64 | UnsetType | None = UNSET
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


class AdapterOut(Struct):
    owner: str
    name: str
    version: int
    digest: str
    rank: int
    targets: list[str]
    size_bytes: int
    created_at: datetime


class AdapterDetail(Struct):
    owner: str
    name: str
    latest: AdapterOut
    versions: list[AdapterOut]
    """Every live version, oldest first."""


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


class AuditOut(Struct):
    id: int
    created_at: datetime
    actor: str
    action: str
    target: str | None
    outcome: str
    detail: dict[str, Any]


class Deleted(Struct):
    """What a DELETE removed."""

    id: str
    deleted: bool = True
    detail: dict[str, int] = msgspec.field(default_factory=dict)


T = TypeVar("T", bound=Struct)
AnyRequest = Request[Any, Any, Any]
_FIELD_PATH = re.compile(r" - at `\$\.([A-Za-z_]\w*)")
_HIDDEN_CHARACTERS = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories that hide or disguise text: controls (NUL, escape), format characters
(bidirectional overrides, zero-width joiners), lone surrogates, line and paragraph separators."""


def check_display_name(value: str, field: str) -> None:
    """Refuse a name people read (in listings, the dashboard, logs) that could disguise itself:
    leading or trailing whitespace, or a character of `_HIDDEN_CHARACTERS`."""
    if value != value.strip():
        raise BadRequest(
            f"{field} may not start or end with whitespace", param=field, code="invalid_request"
        )
    for position, char in enumerate(value):
        if unicodedata.category(char) in _HIDDEN_CHARACTERS:
            raise BadRequest(
                f"{field} may not hold control or format characters "
                f"(U+{ord(char):04X} at position {position})",
                param=field,
                code="invalid_request",
            )


def given(body: Struct) -> dict[str, Any]:
    """The fields a body named (null included); fields left out are not there."""
    return {f: v for f in body.__struct_fields__ if (v := getattr(body, f)) is not UNSET}


async def decode_body(request: AnyRequest, shape: type[T]) -> T:
    """The JSON body as `shape`; an empty body means `{}`. BadRequest on anything malformed."""
    raw = await request.body()
    try:
        return msgspec.json.decode(raw.strip() or b"{}", type=shape)
    except msgspec.ValidationError as exc:
        field = _FIELD_PATH.search(str(exc))
        raise BadRequest(
            f"invalid request body: {exc}",
            param=field[1] if field else None,
            code="invalid_request",
        ) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_request") from None
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not valid UTF-8: {exc}", code="invalid_request") from None


def utc(ts: datetime) -> datetime:
    """Timestamps as UTC; SQLite returns them naive (they were stored as UTC)."""
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def utc_or_none(ts: datetime | None) -> datetime | None:
    return utc(ts) if ts is not None else None
