"""The shared adapter store: every stored adapter's files in the database, by content digest, so
that engine replicas on any machine can fetch an adapter uploaded through any gateway, with no
shared directory (`LORAMUX_ADAPTER_STORE_URL`; see docs/architecture.md).

- `put` copies a validated adapter's files (adapters.store) into `adapter_file_parts`, in parts
  of at most `part_bytes` read one at a time (a put holds about a part in memory), in one
  transaction: a digest's files are all there or none is.
  Putting a digest twice, from two gateways at once included, stores it once.
- `fetch` writes a digest's files into a local adapters.store.AdapterStore, which validates them
  again and names them by the digest of what it copied: bytes changed in the database give
  another digest and are refused (`TamperedAdapter`), never served under the asked name.
- `delete` removes a digest's files: replicas that never fetched it can no longer serve it.
- `present` says which of some digests it still has: replicas retire the others (and remove
  their copies), since a handle cannot tell every replica of a delete.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from collections.abc import Collection
from pathlib import Path

from sqlalchemy import delete, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from loramux.adapters.errors import AdapterError
from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loramux.adapters.store import AdapterStore, StoredAdapter
from loramux.gateway.db.adapter_file import AdapterFilePart
from loramux.gateway.db.session import create_engine

log = logging.getLogger(__name__)

PART_BYTES = 8 << 20
"""Bytes per stored part: far below any database's limit per value (PostgreSQL: 1 GiB)."""
FILES = (CONFIG_FILE, WEIGHTS_FILE)
PRESENT_BATCH = 500
"""Digests per query of `present` (bound parameters stay far below every database's limit)."""
_DIGEST = re.compile(r"[0-9a-f]{64}")


class TamperedAdapter(AdapterError):
    """The database's bytes for a digest are not the adapter that has that digest."""


class SharedAdapterStore:
    def __init__(self, engine: AsyncEngine, part_bytes: int = PART_BYTES) -> None:
        if part_bytes < 1:
            raise ValueError("part_bytes must be positive")
        self.engine = engine
        self.part_bytes = part_bytes

    @classmethod
    def from_url(cls, url: str, part_bytes: int = PART_BYTES) -> SharedAdapterStore:
        """A store in the database at `url` (migrated by the gateway: gateway.db.migrate)."""
        return cls(create_engine(url), part_bytes)

    async def close(self) -> None:
        await self.engine.dispose()

    async def has(self, digest: str) -> bool:
        query = select(AdapterFilePart.part).where(AdapterFilePart.digest == _checked(digest))
        async with self.engine.connect() as conn:
            return (await conn.scalar(query.limit(1))) is not None

    async def present(self, digests: Collection[str]) -> set[str]:
        """Which of `digests` the store has (one query per PRESENT_BATCH of them)."""
        wanted = sorted({_checked(d) for d in digests})
        found: set[str] = set()
        async with self.engine.connect() as conn:
            for i in range(0, len(wanted), PRESENT_BATCH):
                batch = wanted[i : i + PRESENT_BATCH]
                query = select(AdapterFilePart.digest).where(AdapterFilePart.digest.in_(batch))
                found.update(await conn.scalars(query.distinct()))
        return found

    async def put(self, stored: StoredAdapter) -> None:
        """Copy the stored adapter's files in; nothing when the digest is already there."""
        if await self.has(stored.digest):
            return
        try:
            async with self.engine.begin() as conn:
                for name in FILES:
                    await self._insert_parts(conn, stored.digest, name, stored.path / name)
        except IntegrityError:  # another gateway stored the same digest meanwhile
            if not await self.has(stored.digest):
                raise

    async def fetch(self, digest: str, into: AdapterStore) -> StoredAdapter | None:
        """The adapter `digest` in the local store `into`, copied from the database if it is not
        there yet; None when the database does not have it. Raises TamperedAdapter."""
        local = into.get(_checked(digest))
        if local is not None:
            return local
        # In `into`'s own folder, not the temporary folder: what a replica killed mid-fetch
        # leaves goes with that folder (engine.adapter_folder), never piles up beside it.
        work = into.staging_folder("fetch-")
        try:
            if not await self._write_files(digest, work):
                return None
            stored = await asyncio.to_thread(into.put, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if stored.digest != digest:
            await asyncio.to_thread(into.delete, stored.digest)
            log.error("the database's files for adapter %s have digest %s", digest, stored.digest)
            raise TamperedAdapter(f"the stored files of adapter {digest} do not have its digest")
        return stored

    async def delete(self, digest: str, session: AsyncSession | None = None) -> None:
        """Remove the digest's files; inside `session`'s transaction when it is on this store's
        database (a second writer would wait for that transaction's lock on SQLite)."""
        statement = delete(AdapterFilePart).where(AdapterFilePart.digest == digest)
        if session is not None and session.bind is self.engine:
            await session.execute(statement)
            return
        async with self.engine.begin() as conn:
            await conn.execute(statement)

    async def _insert_parts(
        self, conn: AsyncConnection, digest: str, name: str, path: Path
    ) -> None:
        """Insert the file at `path` as parts of `part_bytes` (an empty file as one empty part),
        each read off the event loop once the one before is in: a put holds about one part in
        memory, not the whole file and a copy of it in parts (a 512 MiB adapter took 1 GiB)."""
        with await asyncio.to_thread(path.open, "rb") as file:
            part, data = 0, await asyncio.to_thread(file.read, self.part_bytes)
            while data or not part:
                await conn.execute(
                    insert(AdapterFilePart).values(digest=digest, name=name, part=part, data=data)
                )
                part, data = part + 1, await asyncio.to_thread(file.read, self.part_bytes)

    async def _write_files(self, digest: str, folder: Path) -> bool:
        """Stream the digest's parts into files under `folder`; False when it has none."""
        query = (
            select(AdapterFilePart.name, AdapterFilePart.data)
            .where(AdapterFilePart.digest == digest, AdapterFilePart.name.in_(FILES))
            .order_by(AdapterFilePart.name, AdapterFilePart.part)
        )
        found = False
        async with self.engine.connect() as conn:
            rows = await conn.stream(query)
            async for name, data in rows:
                found = True
                with (folder / name).open("ab") as out:
                    await asyncio.to_thread(out.write, data)
        return found


def _checked(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"{repr(digest)[:80]} is not an adapter digest")
    return digest
