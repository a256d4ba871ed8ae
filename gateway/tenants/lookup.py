"""Finding a tenant by what an admin calls it: its id or its name, wherever one is taken.

Ids are tried first; no tenant's name looks like an id or is `shared` (`check_tenant_name`), so
a reference never means two tenants.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.gateway.admin.wire import check_display_name
from loramux.gateway.db import Tenant
from loramux.gateway.db.adapter import SHARED_OWNER
from loramux.gateway.db.tenant import TENANT_ID_PREFIX
from loramux.gateway.errors import NUL, BadRequest, NotFound


async def get_tenant(session: AsyncSession, ref: str) -> Tenant:
    """The tenant whose id or name is `ref`. No id or name holds NUL (nor can PostgreSQL compare
    text holding it), so a `ref` holding it names no tenant on any database."""
    tenant = await session.get(Tenant, ref) if NUL not in ref else None
    if tenant is None and NUL not in ref:
        tenant = await session.scalar(select(Tenant).where(Tenant.name == ref))
    if tenant is None:
        raise NotFound(
            f"no tenant with the id or name {ref!r}", param="id", code="tenant_not_found"
        )
    return tenant


async def lock_tenant(session: AsyncSession, tenant_id: str) -> bool:
    """Lock the tenant's row until the session's transaction ends, by a write that changes
    nothing (PostgreSQL: the row; SQLite: the database, which takes no lock for a read);
    whether the tenant exists. A tenant's delete and a publish of its adapter both lock it
    first, so the two never interleave."""
    locked = await session.execute(
        update(Tenant).where(Tenant.id == tenant_id).values(disabled=Tenant.disabled)
    )
    return bool(locked.rowcount)  # type: ignore[attr-defined]


async def get_locked_tenant(session: AsyncSession, ref: str) -> Tenant:
    """The tenant whose id or name is `ref`, its row locked (`lock_tenant`) and read again
    under the lock; NotFound when there is none, also when it was deleted between the read and
    the lock. Every write of a tenant's row, or of a row that refers to it (a key, a quota),
    takes it first, so a delete of the tenant either comes after it and removes what it wrote,
    or came before it and this is a 404. Reading then writing without it, a PATCH racing the
    delete updated no row (StaleDataError) and a new key's INSERT failed its foreign key: 500s."""
    tenant = await get_tenant(session, ref)
    if not await lock_tenant(session, tenant.id):
        raise NotFound(
            f"no tenant with the id or name {ref!r}", param="id", code="tenant_not_found"
        )
    await session.refresh(tenant)  # what a writer that held the lock before us changed
    return tenant


async def lock_owner(session: AsyncSession, owner: str) -> None:
    """Lock an adapter owner's row until the transaction ends (a publish's; nothing for
    `shared`); NotFound when the tenant was deleted since the publish checked it. The lock is a write that changes nothing: a row lock on
    PostgreSQL, and on SQLite the database's write lock, which a SELECT ... FOR UPDATE does not
    take there. A tenant's delete writes first too (`lock_tenant`): either it
    finds this version and deletes it, or this publish finds the tenant gone. A publish used
    to commit a live version of a tenant deleted meanwhile, which no admin route could delete."""
    if owner == SHARED_OWNER:
        return
    if not await lock_tenant(session, owner):
        raise NotFound(
            f"tenant {owner!r} was deleted while its adapter was being published",
            param="owner",
            code="tenant_not_found",
        )


async def tenant_id_of(session: AsyncSession, ref: str) -> str:
    """The id of the tenant named `ref`, else `ref` itself: for filters over history, where a
    deleted tenant's id still names its rows."""
    named = await session.scalar(select(Tenant.id).where(Tenant.name == ref))
    return named if named is not None else ref


async def owner_id(session: AsyncSession, ref: str) -> str:
    """An adapter owner: `shared`, or the id of the tenant whose id or name is `ref`."""
    if ref == SHARED_OWNER:
        return SHARED_OWNER
    try:
        return (await get_tenant(session, ref)).id
    except NotFound:
        raise NotFound(
            f"no tenant with the id or name {ref!r}: an owner is a tenant or {SHARED_OWNER!r}",
            param="owner",
            code="tenant_not_found",
        ) from None


_UNADDRESSABLE = frozenset("/?#")
"""Characters no tenant name holds: a name is a path segment (`/admin/tenants/{tenant}`, where
`%2F` is decoded before routing) and the owner of an `owner/name` model (split at its first
`/`). Names created before this rule keep working by id."""


def check_tenant_name(name: str) -> None:
    """Refuse a tenant name that could be read as something else: `shared` (the owner of shared
    adapters), anything shaped like a tenant id, or a name no path or model could address (one
    holding `/`, `?` or `#`, or of dots alone, which a URL's path resolves away)."""
    check_display_name(name, "name")
    if name == SHARED_OWNER or name.startswith(TENANT_ID_PREFIX):
        raise BadRequest(
            f"a tenant may not be named {SHARED_OWNER!r} or start with {TENANT_ID_PREFIX!r}",
            param="name",
            code="invalid_request",
        )
    if _UNADDRESSABLE.intersection(name) or not name.strip("."):
        raise BadRequest(
            "a tenant name may not hold '/', '?' or '#', nor be dots alone",
            param="name",
            code="invalid_request",
        )
