"""Adapter uploads that arrive in parts (`register-part` calls, engine.service.wire): each frame
stays far below the socket's frame limit, so that limit can be small (what a peer without a key
can make the engine buffer), while an adapter may be hundreds of MiB.

A part is written to disk as it arrives, so an upload under way holds no more memory than one
part. Parts of one upload (one gateway, one digest) come in order; a part at offset 0 starts
the upload anew. Bounds: an adapter of at most `max_adapter_bytes` (config and weights), and at
most `max_partial_bytes` announced by the uploads under way together (past it a new upload is
refused as overloaded: the gateway tries another engine, or answers 503). An upload that gets
no part for ABANDONED_SECONDS is dropped with its files (its gateway gave up, or is gone). The
complete adapter is checked against its digest when it is registered (engine.service.uploads).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from loramux.adapters.errors import FileTooLarge
from loramux.adapters.peft_format import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE
from loramux.engine.errors import (
    EngineOverloadedError,
    InvalidRequestError,
    UnknownAdapterError,
)

ABANDONED_SECONDS = 60.0
"""An upload that gets no part this long is dropped (a gateway waits 30 s for a part's answer)."""


@dataclass(eq=False)
class _Upload:
    folder: Path
    size: int
    """The weights' whole size."""
    reserved: int
    """Config and weights: what the upload counts against `max_partial_bytes`."""
    received: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    timer: asyncio.TimerHandle | None = None
    retired: bool = False
    """Dropped because its digest was retired meanwhile (`cancel`)."""


class UploadParts:
    """The uploads under way on one engine, keyed by (gateway routing id, digest)."""

    def __init__(self, folder: Path, max_adapter_bytes: int, max_partial_bytes: int):
        self.folder = folder
        """Where uploads under way keep their files (in the run's own adapter folder)."""
        self.max_adapter_bytes = max_adapter_bytes
        self.max_partial_bytes = max_partial_bytes
        self._uploads: dict[tuple[bytes, str], _Upload] = {}
        self.abandoned_seconds = ABANDONED_SECONDS
        self._removals: set[asyncio.Task[None]] = set()
        """Dropped uploads' folders being removed (`_remove`)."""

    @property
    def reserved(self) -> int:
        """The bytes the uploads under way announced, together."""
        return sum(upload.reserved for upload in self._uploads.values())

    async def receive(
        self, key: tuple[bytes, str], config: bytes | None, part: bytes, offset: int, size: int
    ) -> Path | None:
        """Store one part; the folder holding the whole adapter once this part completes it
        (the caller registers it, then removes the folder), else None. Typed errors for a part
        out of order or over the bounds (the upload is then dropped)."""
        upload = self._start(key, config, size) if offset == 0 else self._uploads.get(key)
        if upload is None or upload.size != size:
            self._drop(key)
            raise InvalidRequestError("an adapter part came with no upload under way for it")
        async with upload.lock:
            if self._uploads.get(key) is not upload or upload.received != offset:
                self._drop(key)
                raise InvalidRequestError(f"an adapter part came out of order (at {offset})")
            if offset + len(part) > size:
                self._drop(key)
                raise InvalidRequestError("an adapter part goes past the size it announced")
            with contextlib.suppress(FileNotFoundError):  # dropped meanwhile: its folder went
                await asyncio.to_thread(_append, upload.folder / WEIGHTS_FILE, part)
            if upload.retired:
                raise UnknownAdapterError("the adapter was retired while it was uploaded")
            if self._uploads.get(key) is not upload:
                raise InvalidRequestError("the upload was dropped (started anew, or abandoned)")
            upload.received += len(part)
            if upload.received < size:
                self._keep(key, upload)
                return None
            self._forget(key)
            return upload.folder

    def _start(self, key: tuple[bytes, str], config: bytes | None, size: int) -> _Upload:
        """A new upload for `key` (replacing one under way), its config written."""
        self._drop(key)
        if config is None:
            raise InvalidRequestError("an upload's first part carries the adapter's config")
        if len(config) > MAX_CONFIG_BYTES or len(config) + size > self.max_adapter_bytes:
            raise FileTooLarge(
                f"the adapter's files hold {len(config) + size} bytes; this engine takes "
                f"adapters of at most {self.max_adapter_bytes} bytes (and a config of at most "
                f"{MAX_CONFIG_BYTES})"
            )
        if self.reserved + len(config) + size > self.max_partial_bytes:
            raise EngineOverloadedError(
                "the engine has as many adapter uploads under way as it takes"
            )
        self._sweep()
        self.folder.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=self.folder))
        (folder / CONFIG_FILE).write_bytes(config)
        (folder / WEIGHTS_FILE).touch()
        upload = self._uploads[key] = _Upload(folder, size, len(config) + size)
        self._keep(key, upload)
        return upload

    def cancel(self, digest: str) -> None:
        """Drop every upload of `digest` under way: it is being retired (its tenant deleted
        it), and an upload finished after the retire would serve it, and keep its files, for
        good. Their next parts are refused as for an unknown adapter."""
        for key in [key for key in self._uploads if key[1] == digest]:
            self._uploads[key].retired = True
            self._drop(key)

    def _keep(self, key: tuple[bytes, str], upload: _Upload) -> None:
        """(Re)start the upload's abandonment timer."""
        if upload.timer is not None:
            upload.timer.cancel()
        loop = asyncio.get_running_loop()
        upload.timer = loop.call_later(self.abandoned_seconds, self._abandon, key, upload)

    def _abandon(self, key: tuple[bytes, str], upload: _Upload) -> None:
        if self._uploads.get(key) is upload:
            self._drop(key)

    def _forget(self, key: tuple[bytes, str]) -> _Upload | None:
        """No longer under way (its files stay)."""
        upload = self._uploads.pop(key, None)
        if upload is not None and upload.timer is not None:
            upload.timer.cancel()
        return upload

    def _drop(self, key: tuple[bytes, str]) -> None:
        """No longer under way, and its files removed (soon: `_remove`)."""
        upload = self._forget(key)
        if upload is not None:
            removal = asyncio.get_running_loop().create_task(self._remove(upload))
            self._removals.add(removal)
            removal.add_done_callback(self._removals.discard)

    async def _remove(self, upload: _Upload) -> None:
        """Remove a dropped upload's folder once no part of it is being written (under its
        lock) and off the event loop: removed while a part's write ran on its thread, the
        folder lost its file, the write made it again, and the folder stayed for good."""
        async with upload.lock:
            await asyncio.to_thread(shutil.rmtree, upload.folder, True)

    async def settled(self) -> None:
        """Return once the folders of the uploads dropped so far are removed."""
        while self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)

    def _sweep(self) -> None:
        """With no upload under way or being removed, remove whatever is in the uploads' folder:
        nothing owns it (a folder a removal could not remove, or a part written after it)."""
        if self._uploads or self._removals or not self.folder.exists():
            return
        for entry in self.folder.iterdir():
            shutil.rmtree(entry, ignore_errors=True)

    def close(self) -> None:
        for removal in self._removals:
            removal.cancel()
        for key in list(self._uploads):
            upload = self._forget(key)
            assert upload is not None
            shutil.rmtree(upload.folder, ignore_errors=True)


def _append(path: Path, data: bytes) -> None:
    """Append to an upload's weights file; FileNotFoundError once its upload was dropped (the
    file is never created here: a part written after its folder went does not make it again)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    with os.fdopen(fd, "ab") as file:
        file.write(data)
