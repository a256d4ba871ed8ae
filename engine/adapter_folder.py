"""An engine's own adapter folder: a content-addressed store (adapters.store) that is only a
cache of adapters held elsewhere, so nothing in it needs to outlive its use by this engine. Two
fill one: an engine service with what gateways upload to it (engine.service.uploads), and a Ray
engine replica with what it fetches from the shared adapter store (engine.ray_deployment). The
source stores an adapter again whenever the engine lacks it, so:

- each run stores in a folder of its own, removed when the run ends (`close`), and at a start
  the folders of runs whose process is gone: what they stored may since have been deleted by
  its tenant, and nothing else would ever remove it. Engines may share the root (one per GPU on
  one volume, or every Ray replica of a host in its temporary folder): none removes another's
  live files;
- a retired adapter's files are removed once the engine drops it (its last request ended):
  they used to stay for good, a deleted tenant's weights included.

A registration and a removal of the same digest never interleave (a lock per digest): a
removal finds the digest registered again and leaves it, or a registration finds the files
gone and stores them again from its source.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from loramux.adapters.store import AdapterStore, StoredAdapter
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import InvalidRequestError

Fill = Callable[[AdapterStore], Awaitable[StoredAdapter | None]]
"""Stores an adapter into the folder's store from its source; None when the source lacks it."""


class EngineAdapterFolder:
    def __init__(
        self, engine: AsyncEngine, root: Path | None, prefix: str = "loramux-engine-adapters-"
    ):
        """This run's folder under `root`; under a temporary root of its own, removed by
        `close`, when `root` is None."""
        self.engine = engine
        self._temporary = root is None
        self.root = Path(tempfile.mkdtemp(prefix=prefix)) if root is None else root
        self.folder, self._alive = _own_run_folder(self.root)
        lora = engine.engine.lora
        self.store = None if lora is None else AdapterStore(self.folder, lora.base, lora.limits)
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def start(self) -> None:
        """Remove each adapter the engine drops, from now on (call on the serving loop)."""
        lora = self.engine.engine.lora
        if lora is None:
            return
        loop = asyncio.get_running_loop()

        def dropped(digest: str) -> None:  # step thread, under the manager's lock
            loop.call_soon_threadsafe(lambda: loop.create_task(self.remove(digest)))

        lora.on_drop = dropped

    async def register_from(self, digest: str, fill: Fill) -> bool:
        """Serve `digest` from this folder, stored there first by `fill` when absent; False when
        the source lacks it. Refused (InvalidRequestError) unless what is stored has `digest`:
        then nothing is registered (a valid adapter that merely has another digest stays in the
        content-addressed store, unserved, until the next start)."""
        if self.store is None:
            raise InvalidRequestError("this engine was started without LoRA support")
        store = self.store
        try:
            stored = store.get(digest)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        async with self._lock(digest):
            if stored is None or digest not in store:
                stored = await fill(store)
                if stored is None:
                    return False
            if stored.digest != digest:
                raise InvalidRequestError(f"the adapter has digest {stored.digest}, not {digest!r}")
            await self.engine.register_adapter(stored.path)
        return True

    async def remove(self, digest: str) -> None:
        """Remove the digest's files unless the engine holds it (registered again meanwhile, or
        retired with requests still on it: its drop removes them then)."""
        lora, store = self.engine.engine.lora, self.store
        if lora is None or store is None:
            return
        async with self._lock(digest):
            if not lora.holds(digest):
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
        """Remove this run's folder (its temporary root with it) and release its lock. Once."""
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
