"""Adapters: versions of `owner/name` in SQL, files in the content-addressed store, digests in
the engine.

Publishing a version, in this order, so that each step can be undone by the next one failing:
1. `store.put` validates the files and stores them by digest (nothing is stored on refusal);
2. the engine loads the digest (`ensure_adapter`); a refusal there discards the stored folder;
3. the row `owner/name` version max+1 is committed: from now on the catalog resolves to it
   (a row never names a digest the engine could not load);
4. the previous version's digest is retired unless another adapter still serves it.

A digest *serves* while it is the latest live version of some `owner/name`: several adapters
may share one digest (identical content), so a digest is retired only when none serves it.
Deleting soft-deletes rows (versions keep counting up after a delete) and retires digests;
requests in flight finish on them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from adapters.archive import ArchiveLimits, extract_adapter_archive
from adapters.peft_format import MAX_CONFIG_BYTES
from adapters.store import StoredAdapter
from gateway.admin.schemas import AdapterDetail, AdapterOut, Deleted, utc
from gateway.admin.upload import AdapterUpload
from gateway.audit import audited
from gateway.catalog import latest_version, latest_versions
from gateway.db import AdapterVersion, Tenant
from gateway.db.adapter import SHARED_OWNER
from gateway.db.base import utcnow
from gateway.errors import BadRequest, Conflict, NotFound
from gateway.state import GatewayState

ADAPTER_NAME = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, without '..': a name
is safe in a URL path segment, a file name and `owner/name`, and never looks like an option
(`-x`) or a path step (`.`, `..`)."""
_README_ROOM = 1 << 20


def adapter_out(row: AdapterVersion) -> AdapterOut:
    return AdapterOut(
        owner=row.owner,
        name=row.name,
        version=row.version,
        digest=row.digest,
        rank=row.rank,
        targets=list(row.targets),
        size_bytes=row.size_bytes,
        created_at=utc(row.created_at),
    )


async def publish_upload(gw: GatewayState, upload: AdapterUpload, work: Path) -> AdapterOut:
    """Check the name and owner, unpack the archive (if that is what came), then publish."""
    await check_name_and_owner(gw, upload.name, upload.owner)
    folder = upload.folder
    if folder is None:
        assert upload.archive is not None, "an upload has either files or an archive"
        limits = ArchiveLimits(
            max_total_bytes=gw.store.limits.max_file_bytes + MAX_CONFIG_BYTES + _README_ROOM
        )
        folder = work / "extracted"
        folder.mkdir()
        await asyncio.to_thread(extract_adapter_archive, upload.archive, folder, limits)
    return await publish(gw, upload.owner, upload.name, folder)


async def publish_adapter(
    gw: GatewayState, owner: str, name: str, folder: Path, *, actor: str
) -> AdapterOut:
    """Publish the adapter folder `folder` as the next version of `owner/name`, audited as
    `actor`: the same rules as an upload, for callers outside a request (first start, CLI)."""
    async with audited(gw, actor, "adapter.upload", f"{owner}/{name}") as entry:
        await check_name_and_owner(gw, name, owner)
        adapter = await publish(gw, owner, name, folder)
        entry.detail = {"version": adapter.version, "digest": adapter.digest}
    return adapter


async def check_name_and_owner(gw: GatewayState, name: str, owner: str) -> None:
    if not ADAPTER_NAME.fullmatch(name):
        raise BadRequest(
            "adapter names are 1-64 characters among letters, digits, '.', '_' and '-', "
            "start with a letter or digit and hold no '..'",
            param="name",
            code="invalid_adapter_name",
        )
    if name == gw.model_name:
        raise BadRequest(
            f"{name!r} is the base model's name", param="name", code="invalid_adapter_name"
        )
    if owner == SHARED_OWNER:
        return
    async with gw.sessions() as session:
        if await session.get(Tenant, owner) is None:
            raise NotFound(
                f"no tenant {owner!r}: owner is a tenant id or {SHARED_OWNER!r}",
                param="owner",
                code="tenant_not_found",
            )


async def publish(gw: GatewayState, owner: str, name: str, folder: Path) -> AdapterOut:
    """Store, load and record a new version of `owner/name` (see the module docstring)."""
    stored = await asyncio.to_thread(gw.store.put, folder)
    try:
        await gw.engine.ensure_adapter(stored.digest, stored.path)
        row, previous = await _insert_version(gw, owner, name, stored)
    except Exception:
        await _discard(gw, stored.digest)
        raise
    if previous is not None and previous != row.digest:
        await retire_unused(gw, [previous])
    gw.catalog.invalidate()
    return adapter_out(row)


async def _insert_version(
    gw: GatewayState, owner: str, name: str, stored: StoredAdapter
) -> tuple[AdapterVersion, str | None]:
    """The committed new row, and the digest of the version it replaces (None for the first)."""
    async with gw.sessions() as session:
        previous = await latest_version(session, owner, name)
        top = await session.scalar(
            select(func.max(AdapterVersion.version)).where(
                AdapterVersion.owner == owner, AdapterVersion.name == name
            )
        )
        row = AdapterVersion(
            owner=owner,
            name=name,
            version=(top or 0) + 1,
            digest=stored.digest,
            rank=stored.metadata.rank,
            targets=list(stored.metadata.targets),
            size_bytes=stored.metadata.weights_bytes,
        )
        session.add(row)
        try:
            await session.commit()
        except IntegrityError:
            raise Conflict(
                f"another upload of {owner}/{name} finished first; retry",
                param="name",
                code="version_conflict",
            ) from None
        return row, previous.digest if previous is not None else None


async def _discard(gw: GatewayState, digest: str) -> None:
    """Undo steps 1-2 of a publish that failed later: retire the digest unless it serves, and
    remove its stored folder unless a live row names it."""
    await retire_unused(gw, [digest])
    async with gw.sessions() as session:
        named = await session.scalar(
            select(AdapterVersion.id)
            .where(AdapterVersion.digest == digest, AdapterVersion.deleted_at.is_(None))
            .limit(1)
        )
    if named is None:
        await asyncio.to_thread(gw.store.delete, digest)


async def retire_unused(gw: GatewayState, digests: Iterable[str]) -> None:
    """Retire in the engine each digest that no live adapter serves any more."""
    async with gw.sessions() as session:
        unused = [d for d in set(digests) if not await _serves(session, d)]
    for digest in unused:
        await gw.engine.retire_adapter(digest)


async def _serves(session: AsyncSession, digest: str) -> bool:
    """Whether `digest` is the latest live version of some adapter."""
    pairs = await session.execute(
        select(AdapterVersion.owner, AdapterVersion.name)
        .where(AdapterVersion.digest == digest, AdapterVersion.deleted_at.is_(None))
        .distinct()
    )
    for owner, name in pairs:
        latest = await latest_version(session, owner, name)
        if latest is not None and latest.digest == digest:
            return True
    return False


async def list_latest(gw: GatewayState, owner: str | None) -> list[AdapterOut]:
    """The latest live version of every adapter (of one owner, when given)."""
    async with gw.sessions() as session:
        rows = await latest_versions(session, [owner] if owner is not None else None)
    return [adapter_out(r) for r in rows]


async def detail(gw: GatewayState, owner: str, name: str) -> AdapterDetail:
    async with gw.sessions() as session:
        rows = list(await _live_versions(session, owner, name))
    if not rows:
        raise _no_adapter(owner, name)
    versions = [adapter_out(r) for r in rows]
    return AdapterDetail(owner, name, latest=versions[-1], versions=versions)


async def delete(gw: GatewayState, owner: str, name: str) -> Deleted:
    """Soft-delete every live version of `owner/name` and retire their digests."""
    async with gw.sessions() as session:
        rows = list(await _live_versions(session, owner, name))
        if not rows:
            raise _no_adapter(owner, name)
        digests = await soft_delete(session, [r.id for r in rows])
        await session.commit()
    await retire_unused(gw, digests)
    gw.catalog.invalidate()
    return Deleted(f"{owner}/{name}", detail={"versions": len(rows)})


async def soft_delete_owned_by(session: AsyncSession, owner: str) -> tuple[int, set[str]]:
    """Soft-delete every live version owned by `owner` (not committed): (count, digests)."""
    ids = list(
        await session.scalars(
            select(AdapterVersion.id).where(
                AdapterVersion.owner == owner, AdapterVersion.deleted_at.is_(None)
            )
        )
    )
    return len(ids), await soft_delete(session, ids)


async def soft_delete(session: AsyncSession, ids: list[str]) -> set[str]:
    """Mark the rows deleted (not committed); returns their digests."""
    if not ids:
        return set()
    await session.execute(
        update(AdapterVersion).where(AdapterVersion.id.in_(ids)).values(deleted_at=utcnow())
    )
    digests = await session.scalars(
        select(AdapterVersion.digest).where(AdapterVersion.id.in_(ids)).distinct()
    )
    return set(digests)


async def _live_versions(session: AsyncSession, owner: str, name: str) -> Iterable[AdapterVersion]:
    return await session.scalars(
        select(AdapterVersion)
        .where(
            AdapterVersion.owner == owner,
            AdapterVersion.name == name,
            AdapterVersion.deleted_at.is_(None),
        )
        .order_by(AdapterVersion.version)
    )


def _no_adapter(owner: str, name: str) -> NotFound:
    return NotFound(f"no adapter {owner}/{name}", code="adapter_not_found")
