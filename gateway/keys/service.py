"""Tenant API keys: minted here, the secret returned once; only its hash is kept.

Revoking sets `revoked_at` and drops the key from this process's cache, so it fails here at
once; other gateway processes notice within LORAMUX_KEY_CACHE_SECONDS. Revoking twice keeps
the first time.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.gateway.admin.paging import Paging, page_of
from loramux.gateway.admin.wire import check_display_name, utc, utc_input, utc_or_none
from loramux.gateway.auth.api_keys import ApiKeyAuth, mint_key
from loramux.gateway.db import ApiKey
from loramux.gateway.db.base import utcnow
from loramux.gateway.errors import BadRequest, NotFound
from loramux.gateway.keys.schemas import KeyCreate, KeyOut, KeyPage, NewKeyOut
from loramux.gateway.tenants.lookup import get_locked_tenant, get_tenant, lock_tenant


def key_out(key: ApiKey) -> KeyOut:
    return KeyOut(
        id=key.id,
        tenant_id=key.tenant_id,
        prefix=key.prefix,
        name=key.name,
        allowed_models=list(key.allowed_models) if key.allowed_models is not None else None,
        created_at=utc(key.created_at),
        expires_at=utc_or_none(key.expires_at),
        revoked_at=utc_or_none(key.revoked_at),
    )


async def get_key(session: AsyncSession, key_id: str) -> ApiKey:
    key = await session.get(ApiKey, key_id)
    if key is None:
        raise _no_key(key_id)
    return key


async def get_locked_key(session: AsyncSession, key_id: str) -> ApiKey:
    """The key `key_id` with its tenant's row locked (`lock_tenant`), read again under the lock;
    NotFound when there is none, also when its tenant's delete took it after it was read. A key
    goes only with its tenant, so a write of a key's row (a revoke) or of a row that refers to
    it (its quota) takes the lock that delete takes, and never updates a row the delete removed
    (StaleDataError, a 500)."""
    key = await get_key(session, key_id)
    if not await lock_tenant(session, key.tenant_id):
        raise _no_key(key_id)
    await session.refresh(key)
    return key


def _no_key(key_id: str) -> NotFound:
    return NotFound(f"no API key {key_id!r}", param="id", code="key_not_found")


class KeyService:
    """API keys over one database session (one request's)."""

    def __init__(self, session: AsyncSession, keys: ApiKeyAuth) -> None:
        self.session = session
        self.keys = keys

    async def create(self, ref: str, body: KeyCreate) -> NewKeyOut:
        """A new key of the tenant whose id or name is `ref`."""
        if body.name is not None:
            check_display_name(body.name, "name")
        expires_at = _expiry(body)
        new = mint_key()
        # Locked: a delete of the tenant either commits first (404 here) or waits for this
        # commit and takes the key with it; the key's INSERT never meets a missing tenant.
        tenant = await get_locked_tenant(self.session, ref)
        key = ApiKey(
            id=new.id,
            tenant_id=tenant.id,
            name=body.name,
            secret_hash=new.secret_hash,
            allowed_models=body.allowed_models,
            expires_at=expires_at,
        )
        self.session.add(key)
        await self.session.commit()
        return NewKeyOut(**msgspec.structs.asdict(key_out(key)), key=new.key)

    async def list_for_tenant(self, ref: str, paging: Paging) -> KeyPage:
        """A page of the tenant's keys, revoked and expired ones included, oldest first."""
        tenant = await get_tenant(self.session, ref)
        query = (
            select(ApiKey)
            .where(ApiKey.tenant_id == tenant.id)
            .order_by(ApiKey.created_at, ApiKey.id)
        )
        if (matches := paging.name_filter(ApiKey.name)) is not None:
            query = query.where(matches)
        rows, total = await page_of(self.session, query, paging)
        return KeyPage([key_out(k) for k in rows], total, paging.limit, paging.offset)

    async def revoke(self, key_id: str) -> KeyOut:
        key = await get_locked_key(self.session, key_id)
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            await self.session.commit()
        self.keys.forget(key_id)
        return key_out(key)


def _expiry(body: KeyCreate) -> datetime | None:
    """`expires_at` or now + `expires_in`; a time already past is refused."""
    if body.expires_at is not None and body.expires_in is not None:
        raise BadRequest(
            "give expires_at or expires_in, not both", param="expires_in", code="invalid_request"
        )
    if body.expires_in is not None:
        return utcnow() + timedelta(seconds=body.expires_in)
    if body.expires_at is None:
        return None
    expires_at = utc_input(body.expires_at, "expires_at")
    if expires_at <= datetime.now(UTC):
        raise BadRequest("expires_at is in the past", param="expires_at", code="invalid_request")
    return expires_at
