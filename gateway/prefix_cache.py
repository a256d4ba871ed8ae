"""Which prefix-cache namespace a tenant's requests use.

The engine reuses a prompt's KV blocks only between requests with the same `cache_salt`. Each
tenant's requests are salted with its own id, for the base model and shared adapters alike: a
prompt another tenant sent never makes a request cheaper or faster (`cached_tokens`, time to
first token), so no tenant can probe what others send. An operator may opt tenants into one
shared namespace (`prefix_cache_scope: "shared"` in `Tenant.settings`, set with
`PATCH /admin/tenants/{id}`): those tenants reuse each other's prefixes, and only each other's.
"""

from __future__ import annotations

from typing import Any, Literal

PrefixCacheScope = Literal["tenant", "shared"]

SETTING = "prefix_cache_scope"
"""The key of the scope in `Tenant.settings`; absent means `tenant`."""
SHARED_SALT = "shared"
"""The salt of every tenant in the shared scope (tenant ids never take this form)."""


def scope_of(tenant_settings: dict[str, Any]) -> PrefixCacheScope:
    return "shared" if tenant_settings.get(SETTING) == "shared" else "tenant"


def cache_salt(tenant_id: str, tenant_settings: dict[str, Any]) -> str:
    """The prefix-cache salt of the tenant's requests."""
    return SHARED_SALT if scope_of(tenant_settings) == "shared" else tenant_id
