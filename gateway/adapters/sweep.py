"""Adapter files left behind by a gateway process that died mid-way (SIGKILL, out of memory, a
lost machine), swept once when each gateway worker starts:

- a stored folder that no live version names: a publish whose process died between its put and
  its commit, or a delete between its commit and its cleanup. Cleanups run per digest, for a
  publish that fails or a version deleted, so none ever looked at it again, and it stayed for
  good;
- a put's staging folder in the store, and an upload's workspace: their `with` blocks remove
  them, unless the process dies inside.

Each is swept only once nothing in it has changed for `STALE_SECONDS`, so an upload or a put
under way in another worker is left alone. A digest is swept under its cleanup lock, and only
while no publish claims it (adapters.claims): a publish that stored the same bytes just before
the sweep finds them gone once it holds its claim, and stores them again
(`AdapterService.publish`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.gateway.adapters.service import AdapterService
from loramux.gateway.adapters.upload import UPLOADS_FOLDER

if TYPE_CHECKING:
    from loramux.gateway.state import GatewayState

log = logging.getLogger(__name__)

STALE_SECONDS = 3600.0
"""How long nothing in a folder must have changed before a sweep takes it."""


async def sweep_leftovers(state: GatewayState, stale_seconds: float = STALE_SECONDS) -> list[str]:
    """Remove what dead processes left (module docstring); returns the digests swept. A
    failure is logged: the gateway serves all the same."""
    try:
        return await _sweep(state, stale_seconds)
    except Exception:
        log.exception("sweeping the adapter files dead processes left failed")
        return []


async def _sweep(state: GatewayState, stale_seconds: float) -> list[str]:
    before = time.time() - stale_seconds
    store = state.store
    stale = [d for d in await asyncio.to_thread(store.digests) if _stale(store.root / d, before)]
    async with state.sessions() as session:
        adapters = AdapterService(
            session, store, state.engine, state.catalog, state.model_name, state.shared_store
        )
        # A delete's cleanup: files no live version names leave both stores, and the engine.
        await adapters.retire_unused(stale)
    swept = [d for d in stale if d not in store]
    uploads = state.settings.data_dir / UPLOADS_FOLDER
    removed = await asyncio.to_thread(_remove_stale, [store.root / ".incoming", uploads], before)
    if swept or removed:
        log.info(
            "swept %d adapter folders no version names and %d unfinished uploads or puts, left "
            "by a gateway that stopped mid-way",
            len(swept),
            removed,
        )
    return swept


def _remove_stale(folders: list[Path], before: float) -> int:
    """Remove the entries of `folders` in which nothing changed since `before`."""
    removed = 0
    for folder in folders:
        entries = list(folder.iterdir()) if folder.is_dir() else []
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink() and _stale(entry, before):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
    return removed


def _stale(folder: Path, before: float) -> bool:
    """Whether nothing in `folder` (itself included) changed since `before`."""
    try:
        return all(t < before for t in _mtimes(folder))
    except OSError:  # removed meanwhile
        return False


def _mtimes(folder: Path) -> Iterator[float]:
    yield folder.lstat().st_mtime
    for path in folder.rglob("*"):
        yield path.lstat().st_mtime
