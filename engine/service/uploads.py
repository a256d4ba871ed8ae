"""The adapters gateways upload to an engine service: a content-addressed store of the engine's
own (its adapter folder), which is a cache of what gateways hold. Gateways upload an adapter
again whenever the engine lacks it (after a restart, or once it was retired), so:

- each run stores in a folder of its own, removed when the service stops, and at a start the
  folders of runs whose process is gone: what they stored may since have been deleted by its
  tenant, and nothing else would ever remove it. Engines may share the adapter folder (one
  per GPU on one volume): none removes another's live files;
- a retired adapter's files are removed once the engine drops it (its last request ended):
  they used to stay for good, a deleted tenant's weights included.

A registration and a removal of the same digest never interleave (a lock per digest): a
removal finds the digest registered again and leaves it, or a registration finds the files
gone and stores them again from the bytes it carries.

Gateways upload an adapter in parts (engine.service.upload_parts); once the last part is in,
the whole adapter is stored and checked against the digest it was uploaded as.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from loramux.adapters.store import AdapterStore
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import InvalidRequestError
from loramux.engine.service.upload_parts import UploadParts

log = logging.getLogger(__name__)


MAX_ADAPTER_MB = 513
"""The largest adapter (config and weights) the engine takes: the gateway's largest upload
(LORAMUX_MAX_UPLOAD_MB, 512 by default, of weights) and a config of at most 1 MiB. Gateways
learn it from `info` and refuse a larger adapter (413) before sending it."""
PARTIAL_UPLOADS = 4
"""Uploads of the largest adapter that may be under way at once (their parts wait on disk)."""


class UploadedAdapters:
    def __init__(
        self, engine: AsyncEngine, folder: Path | None, max_adapter_mb: int = MAX_ADAPTER_MB
    ):
        self.engine = engine
        self._temporary = folder is None
        self.root = (
            Path(tempfile.mkdtemp(prefix="loramux-engine-adapters-")) if folder is None else folder
        )
        self.folder, self._alive = _own_run_folder(self.root)
        lora = engine.engine.lora
        self.store = None if lora is None else AdapterStore(self.folder, lora.base, lora.limits)
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self.max_adapter_bytes = max_adapter_mb << 20
        self.parts = UploadParts(
            self.folder / ".uploading",
            self.max_adapter_bytes,
            PARTIAL_UPLOADS * self.max_adapter_bytes,
        )

    def start(self) -> None:
        """Remove each adapter the engine drops, from now on (call on the serving loop)."""
        lora = self.engine.engine.lora
        if lora is None:
            return
        loop = asyncio.get_running_loop()

        def dropped(digest: str) -> None:  # step thread, under the manager's lock
            loop.call_soon_threadsafe(lambda: loop.create_task(self._remove(digest)))

        lora.on_drop = dropped

    async def receive_part(
        self,
        gateway: bytes,
        digest: str,
        config: bytes | None,
        part: bytes,
        offset: int,
        size: int,
    ) -> int | str:
        """Take one part of `gateway`'s upload of `digest` (engine.service.upload_parts): the
        weights' bytes received so far, or, once the adapter is complete, `digest` with the
        adapter registered (see `register`)."""
        self._store_for(digest)
        whole = await self.parts.receive((gateway, digest), config, part, offset, size)
        if whole is None:
            return offset + len(part)
        try:
            await self.register(digest, whole)
        finally:
            await asyncio.to_thread(shutil.rmtree, whole, True)
        return digest

    def _store_for(self, digest: str) -> AdapterStore:
        """The store, once `digest` is known to be a digest (InvalidRequestError otherwise,
        as on an engine without LoRA support)."""
        if self.store is None:
            raise InvalidRequestError("this engine was started without LoRA support")
        try:
            self.store.get(digest)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        return self.store

    async def register(self, digest: str, folder: Path) -> None:
        """Store the adapter in `folder` (the store copies what it keeps) and serve it;
        refused unless its content has `digest`.

        A refused upload registers nothing (a valid adapter that merely has another digest
        stays in the content-addressed store, unserved, until the next start)."""
        store = self._store_for(digest)
        async with self._lock(digest):
            stored = store.get(digest)
            if stored is None:
                stored = await asyncio.to_thread(store.put, folder)
            if stored.digest != digest:
                raise InvalidRequestError(
                    f"the uploaded adapter has digest {stored.digest}, not {digest!r}"
                )
            await self.engine.register_adapter(stored.path)

    async def _remove(self, digest: str) -> None:
        lora, store = self.engine.engine.lora, self.store
        if lora is None or store is None:
            return
        async with self._lock(digest):
            if not lora.holds(digest):  # not registered again meanwhile
                await asyncio.to_thread(store.delete, digest)

    @contextlib.asynccontextmanager
    async def _lock(self, digest: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(digest, (asyncio.Lock(), 0))
        self._locks[digest] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[digest]
            if users == 1:
                del self._locks[digest]
            else:
                self._locks[digest] = (lock, users - 1)

    def close(self) -> None:
        self.parts.close()
        shutil.rmtree(self.root if self._temporary else self.folder, ignore_errors=True)
        os.close(self._alive)


def _own_run_folder(root: Path) -> tuple[Path, int]:
    """A folder of this run's own under `root`, marked alive by a lock held while the process
    lives (`.alive`, flock), and the lock's descriptor. Engines may share `root` (one per GPU
    on one volume): each removes only its own files, and, at its start, the folders of runs
    whose process is gone (their lock is free) and files of the earlier flat layout."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"run-{os.getpid()}-{secrets.token_hex(4)}"
    starting = root / f".{name}"  # locked before it is named: never seen unlocked
    starting.mkdir()
    alive = os.open(starting / ".alive", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(alive, fcntl.LOCK_EX)
    own = starting.rename(root / name)
    for entry in root.iterdir():
        if entry == own or entry.name.startswith("."):
            continue
        if not entry.name.startswith("run-") or _gone(entry):
            shutil.rmtree(entry, ignore_errors=True)
    return own, alive


def _gone(run: Path) -> bool:
    """Whether the process that made `run` is gone: its `.alive` lock is free."""
    try:
        fd = os.open(run / ".alive", os.O_RDWR)
    except OSError:  # removed meanwhile
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True
