"""Adapters: versions of `owner/name` in SQL, files in the content-addressed store, digests in
the engine.

Publishing a version, in this order, so that each step can be undone by the next one failing:
1. `store.put` validates the files and stores them by digest (nothing is stored on refusal);
2. the engine loads the digest (`ensure_adapter`); a refusal there discards the stored folder;
3. the row `owner/name` version max+1 is committed: from now on the catalog resolves to it
   (a row never names a digest the engine could not load);
4. the previous version's digest is retired unless another adapter still serves it.

A digest *serves* while it is the latest live version of some `owner/name`: several adapters
may share one digest (identical content), so a digest is retired only when none serves it. Its
files stay in the stores while any live version names it (an older version can be pinned), and
while any gateway worker of the host publishes the same bytes: a publish claims its digest from
its put to its commit (adapters.claims), and a cleanup leaves a claimed digest alone (a failed
publish of tenant B, or B deleting an adapter, must not take the files, or the engine's copy,
from under tenant A's publish of identical content in another worker).
Deleting soft-deletes rows (versions keep counting up after a delete) and retires digests;
requests in flight finish on them.

Uploading the bytes of the current version again publishes nothing and answers that version
(idempotent by digest). Making an older version current publishes its digest again as version
max+1: versions only count up, so a pin (`name@3`) keeps meaning what it meant, and the latest
live version stays the one that serves. Deleting one version soft-deletes that row alone; when
it was the current one, the newest live version before it serves again. Older live versions
stay in the store, so a pinned request loads its digest on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.adapters.archive import ArchiveLimits, extract_adapter_archive
from loramux.adapters.peft_format import MAX_CONFIG_BYTES
from loramux.adapters.store import AdapterStore, StoredAdapter
from loramux.gateway.adapters.claiming import claim, cleanup_turn
from loramux.gateway.adapters.schemas import AdapterDetail, AdapterOut, AdapterPage, Published
from loramux.gateway.adapters.shared_store import SharedAdapterStore
from loramux.gateway.adapters.upload import AdapterUpload
from loramux.gateway.admin.paging import Paging, page_of
from loramux.gateway.admin.wire import Deleted, utc
from loramux.gateway.catalog import (
    ModelCatalog,
    latest_version,
    latest_versions_query,
    live_version,
)
from loramux.gateway.db import AdapterVersion
from loramux.gateway.db.base import utcnow
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.errors import BadRequest, Conflict, NotFound
from loramux.gateway.tenants.lookup import lock_owner, owner_id

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


class AdapterService:
    """Adapter versions over one database session (one request's, or a caller's outside a
    request), with the store, the engine and the catalog they must agree with."""

    def __init__(
        self,
        session: AsyncSession,
        store: AdapterStore,
        engine: EngineClient,
        catalog: ModelCatalog,
        model_name: str,
        shared: SharedAdapterStore | None = None,
    ) -> None:
        self.session = session
        self.store = store
        self.shared = shared
        """The shared adapter store engine replicas elsewhere fetch from, if configured."""
        self.engine = engine
        self.catalog = catalog
        self.model_name = model_name

    async def publish_upload(self, upload: AdapterUpload, work: Path) -> Published:
        """Check the name and owner, unpack the archive (if that is what came), then publish."""
        owner = await self.check_name_and_owner(upload.name, upload.owner)
        folder = upload.folder
        if folder is None:
            assert upload.archive is not None, "an upload has either files or an archive"
            limits = ArchiveLimits(
                max_total_bytes=self.store.limits.max_file_bytes + MAX_CONFIG_BYTES + _README_ROOM
            )
            folder = work / "extracted"
            folder.mkdir()
            await asyncio.to_thread(extract_adapter_archive, upload.archive, folder, limits)
        return await self.publish(owner, upload.name, folder)

    async def check_name_and_owner(self, name: str, owner: str) -> str:
        """The owner's id (`owner` is a tenant's id or name, or `shared`), once `name` is a
        valid adapter name."""
        if not ADAPTER_NAME.fullmatch(name):
            raise BadRequest(
                "adapter names are 1-64 characters among letters, digits, '.', '_' and '-', "
                "start with a letter or digit and hold no '..'",
                param="name",
                code="invalid_adapter_name",
            )
        if name == self.model_name:
            raise BadRequest(
                f"{name!r} is the base model's name", param="name", code="invalid_adapter_name"
            )
        return await owner_id(self.session, owner)

    async def publish(self, owner: str, name: str, folder: Path) -> Published:
        """Store, load and record a new version of `owner/name` (see the module docstring);
        the current version when it holds the same bytes."""
        stored = await asyncio.to_thread(self.store.put, folder)
        async with self._claimed(stored.digest):
            if stored.digest not in self.store:  # a cleanup took it just before the claim
                stored = await asyncio.to_thread(self.store.put, folder)
            if self.shared is not None:
                await self.shared.put(stored)
            current = await latest_version(self.session, owner, name)
            if current is not None and current.digest == stored.digest:
                return Published(adapter_out(current), created=False)
            return await self._publish_stored(owner, name, stored)

    @contextlib.asynccontextmanager
    async def _claimed(self, digest: str) -> AsyncIterator[None]:
        """A publish's claim on `digest` (adapters.claims) for the block; when the block fails,
        the session is rolled back and, the claim released, the publish undone (`_discard`).
        Cancelled too (a worker shutting down): otherwise the stored folder, named by no row,
        stayed for good. The undoing is shielded from a second cancellation."""
        held = await claim(self.store.claims, digest)
        try:
            with held:
                yield
        except (Exception, asyncio.CancelledError):
            await asyncio.shield(self._undo(digest))
            raise

    async def _undo(self, digest: str) -> None:
        await self.session.rollback()
        await self._discard(digest)

    async def _publish_stored(self, owner: str, name: str, stored: StoredAdapter) -> Published:
        """Steps 2-4, inside `_claimed(stored.digest)`."""
        await self.engine.ensure_adapter(stored.digest, stored.path)
        row, previous = await self._insert_version(owner, name, stored)
        if not isinstance(row, AdapterVersion):  # the current version already holds these bytes
            return Published(row, created=False)
        if previous is not None and previous != row.digest:
            await self.retire_unused([previous])
        self.catalog.invalidate()
        return Published(adapter_out(row), created=True)

    async def make_current(self, owner_ref: str, name: str, version: int) -> Published:
        """Make live `version` the one that serves: published again as the newest version
        (the current version itself when it already is)."""
        owner = await owner_id(self.session, owner_ref)
        row = await _live_version(self.session, owner, name, version)
        current = await latest_version(self.session, owner, name)
        if current is not None and current.digest == row.digest:
            return Published(adapter_out(current), created=False)
        stored = await asyncio.to_thread(self.store.get, row.digest)
        if stored is None:
            raise Conflict(
                f"the files of {owner}/{name} version {version} are gone from the store",
                code="adapter_files_missing",
            )
        async with self._claimed(stored.digest):
            return await self._publish_stored(owner, name, stored)

    async def delete_version(self, owner_ref: str, name: str, version: int) -> Deleted:
        """Soft-delete one live version and retire its digest unless it still serves."""
        owner = await owner_id(self.session, owner_ref)
        row = await _live_version(self.session, owner, name, version)
        digests = await _soft_delete(self.session, [row.id])
        await self.session.commit()
        await self.retire_unused(digests)
        self.catalog.invalidate()
        return Deleted(f"{owner}/{name}@{version}", detail={"versions": 1})

    async def _insert_version(
        self, owner: str, name: str, stored: StoredAdapter
    ) -> tuple[AdapterVersion | AdapterOut, str | None]:
        """The committed new row, and the digest of the version it replaces (None for the
        first); or the current version, when it already holds these bytes: published by an
        upload of the same bytes that took the owner's lock first (a client retrying a timed-out
        upload). Both used to publish, as versions n and n + 1 of one digest."""
        await lock_owner(self.session, owner)
        # The top version before the current one: `shared` has no row to lock, and a publish
        # of the same bytes that commits after the first read commits the version this one
        # would (a conflict, below) or is seen by the second (PostgreSQL reads what each
        # statement finds committed).
        top = await self.session.scalar(
            select(func.max(AdapterVersion.version)).where(
                AdapterVersion.owner == owner, AdapterVersion.name == name
            )
        )
        previous = await latest_version(self.session, owner, name)
        if previous is not None and previous.digest == stored.digest:
            same = adapter_out(previous)
            await self.session.rollback()
            return same, None
        row = AdapterVersion(
            owner=owner,
            name=name,
            version=(top or 0) + 1,
            digest=stored.digest,
            rank=stored.metadata.rank,
            targets=list(stored.metadata.targets),
            size_bytes=stored.metadata.weights_bytes,
        )
        self.session.add(row)
        try:
            await self.session.commit()
        except IntegrityError:
            await self.session.rollback()
            won = await latest_version(self.session, owner, name)  # shared: no owner lock
            if won is not None and won.digest == stored.digest:
                return adapter_out(won), None
            raise Conflict(
                f"another upload of {owner}/{name} finished first; retry",
                param="name",
                code="version_conflict",
            ) from None
        return row, previous.digest if previous is not None else None

    async def _discard(self, digest: str) -> None:
        """Undo steps 1-2 of a publish that failed later (`_retire`). Unless another publish of
        the same bytes (another adapter with identical content, in any worker) claims the
        digest: it is about to name it, and needs the folder and the engine's copy."""
        async with self._cleaning(digest) as free:
            if free:
                await self._retire(digest)

    async def retire_unused(self, digests: Iterable[str]) -> None:
        """Retire each digest that no live adapter serves any more (`_retire`), unless a publish
        of the same bytes claims it (it is about to serve it)."""
        for digest in sorted(set(digests)):
            async with self._cleaning(digest) as free:
                if free:
                    await self._retire(digest)

    @contextlib.asynccontextmanager
    async def _cleaning(self, digest: str) -> AsyncIterator[bool]:
        """This cleanup's turn among the digest's (adapters.claims), then whether no publish
        claims it (when True, none can until the block ends)."""
        claims = self.store.claims
        with await cleanup_turn(claims, digest), claims.unclaimed(digest) as free:
            yield free

    async def _retire(self, digest: str) -> None:
        """Unless a live adapter serves `digest`: retire it in the engine; and unless a live
        version names it, delete its files from the local and the shared store (a pinned older
        version loads its digest on demand, from there on replicas that never fetched it). A
        deleted adapter's weights leave the disk with it. Under the digest's cleanup lock
        (`claims.unclaimed`)."""
        if await _serves(self.session, digest):
            return
        await self.engine.retire_adapter(digest)
        if await _named(self.session, digest):
            return
        await asyncio.to_thread(self.store.delete, digest)
        if self.shared is not None:
            await self.shared.delete(digest, self.session)
            await self.session.commit()  # the store may be this session's database

    async def list_latest(self, owner_ref: str | None, paging: Paging) -> AdapterPage:
        """A page of the latest live version of every adapter (of one owner, when given), by
        owner and name; `paging.name` keeps adapters whose name holds it."""
        owners = None if owner_ref is None else [await owner_id(self.session, owner_ref)]
        query = latest_versions_query(owners)
        if (matches := paging.name_filter(AdapterVersion.name)) is not None:
            query = query.where(matches)
        rows, total = await page_of(self.session, query, paging)
        return AdapterPage([adapter_out(r) for r in rows], total, paging.limit, paging.offset)

    async def detail(self, owner_ref: str, name: str) -> AdapterDetail:
        owner = await owner_id(self.session, owner_ref)
        rows = list(await _live_versions(self.session, owner, name))
        if not rows:
            raise _no_adapter(owner, name)
        versions = [adapter_out(r) for r in rows]
        return AdapterDetail(owner, name, latest=versions[-1], versions=versions)

    async def delete(self, owner_ref: str, name: str) -> Deleted:
        """Soft-delete every live version of `owner/name` and retire their digests."""
        owner = await owner_id(self.session, owner_ref)
        rows = list(await _live_versions(self.session, owner, name))
        if not rows:
            raise _no_adapter(owner, name)
        digests = await _soft_delete(self.session, [r.id for r in rows])
        await self.session.commit()
        await self.retire_unused(digests)
        self.catalog.invalidate()
        return Deleted(f"{owner}/{name}", detail={"versions": len(rows)})

    async def soft_delete_owned_by(self, owner: str) -> tuple[int, set[str]]:
        """Soft-delete every live version owned by `owner` (not committed): (count, digests)."""
        ids = list(
            await self.session.scalars(
                select(AdapterVersion.id).where(
                    AdapterVersion.owner == owner, AdapterVersion.deleted_at.is_(None)
                )
            )
        )
        return len(ids), await _soft_delete(self.session, ids)


async def _named(session: AsyncSession, digest: str) -> bool:
    """Whether a live version (current or older) names `digest`."""
    named = await session.scalar(
        select(AdapterVersion.id)
        .where(AdapterVersion.digest == digest, AdapterVersion.deleted_at.is_(None))
        .limit(1)
    )
    return named is not None


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


async def _soft_delete(session: AsyncSession, ids: list[str]) -> set[str]:
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


async def _live_version(
    session: AsyncSession, owner: str, name: str, version: int
) -> AdapterVersion:
    row = await live_version(session, owner, name, version)
    if row is None:
        raise NotFound(f"no live version {version} of {owner}/{name}", code="adapter_not_found")
    return row


def _no_adapter(owner: str, name: str) -> NotFound:
    return NotFound(f"no adapter {owner}/{name}", code="adapter_not_found")
