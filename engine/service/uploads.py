"""The adapters gateways upload to an engine service: a content-addressed store of the engine's
own (its adapter folder), which is a cache of what gateways hold. Gateways upload an adapter
again whenever the engine lacks it (after a restart, or once it was retired), so:

- the folder is emptied when the service starts: what a previous run stored may since have
  been deleted by its tenant, and nothing else would ever remove it;
- a retired adapter's files are removed once the engine drops it (its last request ended):
  they used to stay for good, a deleted tenant's weights included.

A registration and a removal of the same digest never interleave (a lock per digest): a
removal finds the digest registered again and leaves it, or a registration finds the files
gone and stores them again from the bytes it carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loramux.adapters.store import AdapterStore
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import InvalidRequestError

log = logging.getLogger(__name__)


class UploadedAdapters:
    def __init__(self, engine: AsyncEngine, folder: Path | None):
        self.engine = engine
        self._own_folder = folder is None
        if folder is None:
            folder = Path(tempfile.mkdtemp(prefix="loramux-engine-adapters-"))
        self.folder = folder
        lora = engine.engine.lora
        self.store = None if lora is None else AdapterStore(folder, lora.base, lora.limits)
        if self.store is not None:
            for digest in self.store.digests():  # a previous run's: see the module docstring
                self.store.delete(digest)
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def start(self) -> None:
        """Remove each adapter the engine drops, from now on (call on the serving loop)."""
        lora = self.engine.engine.lora
        if lora is None:
            return
        loop = asyncio.get_running_loop()

        def dropped(digest: str) -> None:  # step thread, under the manager's lock
            loop.call_soon_threadsafe(lambda: loop.create_task(self._remove(digest)))

        lora.on_drop = dropped

    async def register(self, digest: str, config: bytes, weights: bytes) -> None:
        """Store the uploaded adapter and serve it; refused unless its content has `digest`.

        A refused upload registers nothing (a valid adapter that merely has another digest
        stays in the content-addressed store, unserved, until the next start)."""
        if self.store is None:
            raise InvalidRequestError("this engine was started without LoRA support")
        store = self.store
        try:
            stored = store.get(digest)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        async with self._lock(digest):
            if stored is None or digest not in store:
                with tempfile.TemporaryDirectory() as work:  # the store copies what it keeps
                    (Path(work) / CONFIG_FILE).write_bytes(config)
                    (Path(work) / WEIGHTS_FILE).write_bytes(weights)
                    stored = await asyncio.to_thread(store.put, Path(work))
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
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)
