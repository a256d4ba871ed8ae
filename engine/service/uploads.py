"""The adapters gateways upload to an engine service, kept in the engine's own adapter folder
(engine.adapter_folder: a folder per run, swept at start once its run is gone, and a retired
adapter's files removed once the engine drops it). The folder is a cache of what gateways hold:
they upload an adapter again whenever the engine lacks it (after a restart, or once it was
retired).

Gateways upload an adapter in parts (engine.service.upload_parts); once the last part is in,
the whole adapter is stored and checked against the digest it was uploaded as.
"""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from pathlib import Path

from loramux.adapters.store import AdapterStore, StoredAdapter
from loramux.engine.adapter_folder import EngineAdapterFolder
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import InvalidRequestError, UnknownAdapterError
from loramux.engine.service.upload_parts import UploadParts

MAX_ADAPTER_MB = 513
"""The largest adapter (config and weights) the engine takes: the gateway's largest upload
(LORAMUX_MAX_UPLOAD_MB, 512 by default, of weights) and a config of at most 1 MiB. Gateways
learn it from `info` and refuse a larger adapter (413) before sending it."""
PARTIAL_UPLOADS = 4
"""Uploads of the largest adapter that may be under way at once (their parts wait on disk)."""


class UploadedAdapters(EngineAdapterFolder):
    def __init__(
        self, engine: AsyncEngine, folder: Path | None, max_adapter_mb: int = MAX_ADAPTER_MB
    ):
        super().__init__(engine, folder)
        self.max_adapter_bytes = max_adapter_mb << 20
        self.parts = UploadParts(
            self.folder / ".uploading",
            self.max_adapter_bytes,
            PARTIAL_UPLOADS * self.max_adapter_bytes,
        )
        self._registering: Counter[str] = Counter()
        """Uploads whose last part is in, being registered, by digest."""
        self._retired: set[str] = set()
        """Digests retired while an upload of theirs was being registered."""

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
        adapter registered (see `register`); `digest` at once for a first part that waited for
        another gateway's upload of it, once that one served it."""
        self._check(digest)
        if offset == 0 and await self.parts.wait_turn(gateway, digest) and self._serves(digest):
            return digest  # another gateway's upload of it came first
        whole = await self.parts.receive(gateway, digest, config, part, offset, size)
        if whole is None:
            return offset + len(part)
        self._registering[digest] += 1
        try:
            await self.register(digest, whole)
            if digest in self._retired:  # retired while it was registered: not served
                self.engine.retire_adapter(digest)
                raise UnknownAdapterError("the adapter was retired while it was uploaded")
        finally:
            self._registering[digest] -= 1
            if not self._registering[digest]:
                del self._registering[digest]
                self._retired.discard(digest)
            await asyncio.to_thread(shutil.rmtree, whole, True)
            self.parts.finish(digest)
        return digest

    def _serves(self, digest: str) -> bool:
        lora = self.engine.engine.lora
        return lora is not None and lora.is_servable(digest)

    def retire(self, digest: str) -> bool:
        """Retire `digest` (see AsyncEngine.retire_adapter), its uploads under way cancelled
        and one being registered retired once it is: none of them serves it afterwards."""
        self.parts.cancel(digest)
        if digest in self._registering:
            self._retired.add(digest)
        return self.engine.retire_adapter(digest)

    def _check(self, digest: str) -> None:
        """InvalidRequestError unless `digest` is a digest and the engine serves adapters: a
        part is refused before it is stored."""
        if self.store is None:
            raise InvalidRequestError("this engine was started without LoRA support")
        try:
            self.store.get(digest)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None

    async def register(self, digest: str, folder: Path) -> None:
        """Store the adapter in `folder` (the store copies what it keeps) and serve it; refused
        (InvalidRequestError) unless its content has `digest` (EngineAdapterFolder.register_from)."""

        async def store_upload(store: AdapterStore) -> StoredAdapter:
            return await asyncio.to_thread(store.put, folder)

        await self.register_from(digest, store_upload)

    def close(self) -> None:
        self.parts.close()
        super().close()
