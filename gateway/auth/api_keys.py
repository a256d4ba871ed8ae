"""Tenant API keys: `lmx-<id>.<secret>`.

The id finds the row; only sha256(secret) is stored and it is compared in constant time. The
secret is 32 random bytes, so a fast hash is enough (no password stretching needed). Lookups are
cached in-process for `ttl` seconds: a revoked or expired key stops working within that time in
every gateway process, without a shared cache, and at once in the process that revoked it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db import ApiKey, Tenant
from loramux.gateway.errors import Unauthorized

_KEY = re.compile(r"^lmx-(?P<id>[A-Za-z0-9]{12})\.(?P<secret>[A-Za-z0-9_-]{43})$")


@dataclass(frozen=True)
class NewKey:
    id: str
    key: str
    """The full key, shown once."""
    secret_hash: str

    @property
    def prefix(self) -> str:
        return f"lmx-{self.id}"


def mint_key() -> NewKey:
    key_id = "".join(
        secrets.choice("ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789")
        for _ in range(12)
    )
    secret = secrets.token_urlsafe(32)
    return NewKey(key_id, f"lmx-{key_id}.{secret}", hash_secret(secret))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant through one of its keys."""

    tenant_id: str
    tenant_name: str
    key_id: str
    allowed_models: tuple[str, ...] | None
    tenant_settings: dict[str, object]

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


@dataclass
class _Cached:
    row: tuple[ApiKey, Tenant] | None
    fetched: float


class ApiKeyAuth:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl: float = 2.0):
        self.sessions = sessions
        self.ttl = ttl
        self._cache: dict[str, _Cached] = {}
        self._forgets = 0
        """How many `forget`s so far: a lookup that saw one happen while it read the database
        does not cache what it read (see `_lookup`)."""

    async def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an `Authorization: Bearer lmx-…` header; raises Unauthorized."""
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized("missing API key: send 'Authorization: Bearer lmx-…'")
        match = _KEY.match(authorization[7:].strip())
        if match is None:
            raise Unauthorized("invalid API key")
        row = await self._lookup(match["id"])
        if row is None:
            raise Unauthorized("invalid API key")
        key, tenant = row
        if not hmac.compare_digest(hash_secret(match["secret"]), key.secret_hash):
            raise Unauthorized("invalid API key")
        now = datetime.now(UTC)
        if key.revoked_at is not None:
            raise Unauthorized("this API key has been revoked")
        if key.expires_at is not None and _aware(key.expires_at) <= now:
            raise Unauthorized("this API key has expired")
        if tenant.disabled:
            raise Unauthorized("this tenant is disabled")
        allowed = tuple(key.allowed_models) if key.allowed_models is not None else None
        return Principal(tenant.id, tenant.name, key.id, allowed, dict(tenant.settings or {}))

    def forget(self, key_id: str) -> None:
        """Drop a cached lookup now (this process); others notice within `ttl`."""
        self._cache.pop(key_id, None)
        self._forgets += 1

    async def _lookup(self, key_id: str) -> tuple[ApiKey, Tenant] | None:
        now = time.monotonic()
        cached = self._cache.get(key_id)
        if cached is not None and now - cached.fetched < self.ttl:
            return cached.row
        forgets = self._forgets
        async with self.sessions() as session:
            key = await session.get(ApiKey, key_id)
            tenant = await session.get(Tenant, key.tenant_id) if key is not None else None
        row = (key, tenant) if key is not None and tenant is not None else None
        if len(self._cache) > 100_000:
            self._cache.clear()
        # A revocation (or a tenant disabled) that committed and forgot the key while this read
        # was under way may be newer than the row read: caching it would bring the key back
        # here for `ttl`. The request under way, which came first, still gets the row.
        if self._forgets == forgets:
            self._cache[key_id] = _Cached(row, now)
        return row


def _aware(ts: datetime) -> datetime:
    """SQLite returns naive datetimes; they were stored as UTC."""
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
