"""Wire shapes of `/admin/tenants`."""

from __future__ import annotations

from datetime import datetime

from msgspec import UNSET, Struct, UnsetType

from loramux.gateway.admin.wire import DisplayName
from loramux.gateway.prefix_cache import PrefixCacheScope


class TenantCreate(Struct, forbid_unknown_fields=True):
    name: DisplayName
    """Unique among tenants."""
    prefix_cache_scope: PrefixCacheScope = "tenant"
    """`tenant`: no other tenant's prompts are reused from the prefix cache; `shared`: prompts
    are reused between every tenant in the shared scope (see gateway.prefix_cache)."""


class TenantUpdate(Struct, forbid_unknown_fields=True):
    """Absent fields keep their value."""

    name: DisplayName | UnsetType = UNSET
    disabled: bool | UnsetType = UNSET
    """A disabled tenant's keys stop working (at once in this process)."""
    prefix_cache_scope: PrefixCacheScope | UnsetType = UNSET


class TenantOut(Struct):
    id: str
    name: str
    disabled: bool
    created_at: datetime
    prefix_cache_scope: PrefixCacheScope


class TenantPage(Struct):
    items: list[TenantOut]
    total: int
    """Tenants the filter matches, on every page."""
    limit: int
    offset: int
