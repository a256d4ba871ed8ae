"""Which model a request names: the base model, or an adapter version the tenant may use.

`model` resolves to the tenant's own adapter, then a shared one, then `owner/name` (owner being
the tenant itself, by id or name, or `shared`), then the base model's id. Any of these but the
base model may end in `@version` to pin one live version (`support-bot@2`); without it the
latest live version serves. Another tenant's private adapter resolves exactly like a name that
does not exist. Lookups are cached for a moment; uploads and deletes in this process invalidate
at once. A model longer than any that can resolve (`MAX_MODEL_ID`) is unknown without a lookup.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.db import AdapterVersion
from loramux.gateway.db.adapter import MAX_ADAPTER_NAME, SHARED_OWNER
from loramux.gateway.db.tenant import MAX_TENANT_NAME
from loramux.gateway.errors import NUL, NotFound, PermissionDenied


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    """The name as the request gave it (echoed back as `model`)."""
    digest: str | None
    """Adapter content digest; None for the base model."""
    owner: str | None = None
    version: int | None = None
    adapter: str | None = None
    """The adapter's own name (without owner or version); None for the base model."""
    created: int = 0
    """When the adapter version was uploaded (Unix seconds); 0 for the base model."""

    @property
    def billed_as(self) -> str:
        """What usage records as the model: the adapter however the request named it (`bot`,
        `acme/bot`, `tnt_…/bot@2` are all `bot`; a shared one is `shared/bot`), else the base
        model's id. Never the client's string, which may be longer than any column holds (an
        owner is a tenant name of up to 200 characters): an adapter's name has at most 100."""
        if self.adapter is None:
            return self.name
        return f"{SHARED_OWNER}/{self.adapter}" if self.owner == SHARED_OWNER else self.adapter


MAX_CACHED = 100_000
"""Lookups kept at most (then all are dropped). Misses are kept too, so a flood of unknown
models costs no database query each; a key is at most `MAX_MODEL_ID` characters long."""


class ModelCatalog:
    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], base_model: str, ttl: float = 2.0
    ):
        self.sessions = sessions
        self.base_model = base_model
        self.ttl = ttl
        self._cache: dict[tuple[str, str], tuple[float, AdapterVersion | None]] = {}
        self._visible: dict[str, tuple[float, list[AdapterVersion]]] = {}

    def invalidate(self) -> None:
        self._cache.clear()
        self._visible.clear()

    async def resolve(self, principal: Principal, model: str) -> ResolvedModel:
        """Raises NotFound for unknown (or foreign private) models, PermissionDenied for models the
        key is not allowed to use."""
        if model == self.base_model:
            resolved = ResolvedModel(model, None)
        else:
            row = await self._find(principal, model)
            if row is None:
                raise unknown_model(model)
            created = int(row.created_at.timestamp())
            resolved = ResolvedModel(model, row.digest, row.owner, row.version, row.name, created)
        if not (principal.may_use(model) or principal.may_use(_pinned(model)[0])):
            raise PermissionDenied(
                f"this API key may not use the model '{model}'",
                param="model",
                code="model_not_allowed",
            )
        return resolved

    async def _find(self, principal: Principal, model: str) -> AdapterVersion | None:
        if len(model) > MAX_MODEL_ID:
            return None  # no adapter has a name this long: neither looked up nor cached
        tenant_id = principal.tenant_id
        key = (tenant_id, model)
        cached = self._cache.get(key)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        if NUL in model:
            return None  # no adapter or tenant name holds one, nor can PostgreSQL compare it
        name, version = _pinned(model)
        if "/" in name:
            owner, name = name.split("/", 1)
            owner = tenant_id if owner == principal.tenant_name else owner
            candidates = [owner] if owner in (tenant_id, SHARED_OWNER) else []
        else:
            candidates = [tenant_id, SHARED_OWNER]
        row = None
        async with self.sessions() as session:
            for owner in candidates:
                row = await live_version(session, owner, name, version)
                if row is not None:
                    break
        if len(self._cache) > MAX_CACHED:
            self._cache.clear()
        self._cache[key] = (now, row)
        return row

    async def visible(self, tenant_id: str) -> list[AdapterVersion]:
        """The latest live version of every adapter the tenant may use: its own, then shared.
        Cached for `ttl` like single lookups (uploads in this process invalidate at once)."""
        now = time.monotonic()
        cached = self._visible.get(tenant_id)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        async with self.sessions() as session:
            rows = await latest_versions(session, [tenant_id, SHARED_OWNER])
        rows = sorted(rows, key=lambda r: (r.owner != tenant_id, r.name))
        if len(self._visible) > MAX_CACHED:
            self._visible.clear()
        self._visible[tenant_id] = (now, rows)
        return rows


def unknown_model(model: str) -> NotFound:
    """The 404 of a model that does not exist, or that the caller may not see or use."""
    return NotFound(
        f"The model '{model}' does not exist or you do not have access to it.", param="model"
    )


MAX_VERSION = 2**31 - 1
"""The largest version number the database stores (a 32-bit integer column)."""

MAX_PIN_DIGITS = 9
"""The most digits a pin (`@version`) may have; longer ones are no pin (`_pinned`)."""

MAX_MODEL_ID = MAX_TENANT_NAME + len("/") + MAX_ADAPTER_NAME + len("@") + MAX_PIN_DIGITS
"""The longest model that can resolve to an adapter (`owner/name@version`, the owner a tenant's
name): a longer one is unknown without a lookup, and never kept in the catalog's cache."""


def _pinned(model: str) -> tuple[str, int | None]:
    """`name@3` → (`name`, 3); a name without a well-formed pin → (name, None)."""
    name, at, version = model.rpartition("@")
    if at and version.isascii() and version.isdigit() and len(version) <= MAX_PIN_DIGITS:
        return name, int(version)
    return model, None


async def live_version(
    session: AsyncSession, owner: str, name: str, version: int | None
) -> AdapterVersion | None:
    """Live `version` of `owner/name`; the latest live one when `version` is None. A number
    no version can have (below 1, or past the database's 32-bit column) has none."""
    if version is None:
        return await latest_version(session, owner, name)
    if not 1 <= version <= MAX_VERSION:
        return None
    return await session.scalar(
        select(AdapterVersion).where(
            AdapterVersion.owner == owner,
            AdapterVersion.name == name,
            AdapterVersion.version == version,
            AdapterVersion.deleted_at.is_(None),
        )
    )


async def latest_versions(
    session: AsyncSession, owners: list[str] | None = None
) -> list[AdapterVersion]:
    """The newest live version of every adapter (of `owners`, when given), by owner and name."""
    return list(await session.scalars(latest_versions_query(owners)))


def latest_versions_query(owners: list[str] | None = None) -> Select[AdapterVersion]:
    """The query of `latest_versions`, to filter or page further."""
    newest = select(
        AdapterVersion.owner, AdapterVersion.name, func.max(AdapterVersion.version).label("v")
    ).where(AdapterVersion.deleted_at.is_(None))
    if owners is not None:
        newest = newest.where(AdapterVersion.owner.in_(owners))
    latest = newest.group_by(AdapterVersion.owner, AdapterVersion.name).subquery()
    return (
        select(AdapterVersion)
        .join(
            latest,
            (AdapterVersion.owner == latest.c.owner)
            & (AdapterVersion.name == latest.c.name)
            & (AdapterVersion.version == latest.c.v),
        )
        .order_by(AdapterVersion.owner, AdapterVersion.name)
    )


async def latest_version(session: AsyncSession, owner: str, name: str) -> AdapterVersion | None:
    """The newest live version of `owner/name`."""
    return await session.scalar(
        select(AdapterVersion)
        .where(
            AdapterVersion.owner == owner,
            AdapterVersion.name == name,
            AdapterVersion.deleted_at.is_(None),
        )
        .order_by(AdapterVersion.version.desc())
        .limit(1)
    )
