"""Adapter uploads that arrive in parts (`register-part` calls, engine.service.wire): each frame
stays far below the socket's frame limit, so that limit can be small (what a peer without a key
can make the engine buffer), while an adapter may be hundreds of MiB.

A part is written to disk as it arrives, so an upload under way holds no more memory than one
part. One upload of a digest is under way at a time, its parts from one gateway, in order; a
part at offset 0 from that gateway starts it anew, and one from another gateway waits until it
ends (several gateways missing the digest after an engine restart send it once, not once
each), then finds the digest served or starts its own. Bounds: an adapter of at most
`max_adapter_bytes` (config and weights), and at most `max_partial_bytes` announced by the
uploads under way together (half of it from one gateway), and at most MAX_UPLOADS uploads
(MAX_GATEWAY_UPLOADS from one gateway) whatever their size (past any of these a new upload is
refused as overloaded: the gateway tries another engine, or answers 503). A part past the
first adds bytes or is refused, and a first part waits WAIT_SECONDS at most for another
gateway's upload of its digest. Their files are made and written off the event loop.
A gateway that gives up an upload says so (`abort-upload`) and it is dropped at once; one that
gets no part for ABANDONED_SECONDS is dropped with its files (its gateway is gone). The complete adapter is checked against its digest when it is
registered (engine.service.uploads).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from loramux.adapters.errors import FileTooLarge
from loramux.adapters.peft_format import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE
from loramux.engine.errors import (
    AdapterUnavailableError,
    EngineOverloadedError,
    InvalidRequestError,
    UnknownAdapterError,
)

ABANDONED_SECONDS = 60.0
"""An upload that gets no part this long is dropped (a gateway waits 30 s for a part's answer)."""
WAIT_SECONDS = 120.0
"""A first part waits this long at most for another gateway's upload of its digest, then is
answered as overloaded (retry): below the gateway's wait for a first part's answer (300 s), so
a slow upload by another gateway never looks like a dead engine (which the gateway would then
avoid)."""
MAX_UPLOADS, MAX_GATEWAY_UPLOADS = 16, 4
"""Uploads under way at most, on the engine and from one gateway, whatever their size: each
holds a folder and a timer (tiny ones used to be taken without bound). A gateway's uploads
share its link, so more at once only take longer each; past a bound a new upload is refused
as overloaded (the gateway tries another engine)."""


@dataclass(eq=False)
class _Upload:
    gateway: bytes
    """The routing id of the gateway sending it: only its parts continue it."""
    size: int
    """The weights' whole size."""
    reserved: int
    """Config and weights: what the upload counts against `max_partial_bytes`."""
    received: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    timer: asyncio.TimerHandle | None = None
    retired: bool = False
    """Dropped because its digest was retired meanwhile (`cancel`)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once it is no longer under way (registered, refused, dropped)."""
    folder: Path | None = None
    """Its files, made by its first part (off the event loop)."""
    complete: bool = False
    """Every part is in: it is being registered (`finish` ends it)."""


class UploadParts:
    """The uploads under way on one engine, one per digest: a gateway that uploads a digest
    another is uploading waits for that upload (`wait_turn`) instead of taking a share of its
    own for the same bytes."""

    def __init__(
        self,
        folder: Path,
        max_adapter_bytes: int,
        max_partial_bytes: int,
        max_uploads: int = MAX_UPLOADS,
        max_gateway_uploads: int = MAX_GATEWAY_UPLOADS,
        max_gateway_bytes: int | None = None,
    ):
        self.folder = folder
        """Where uploads under way keep their files (in the run's own adapter folder). Emptied
        here, once: it belongs to this run, so what is in it now no upload owns, and nothing
        under it is removed later but a dropped upload's own folder (a sweep at an upload's
        start, done on a worker thread, took the folder of an upload started meanwhile)."""
        shutil.rmtree(folder, ignore_errors=True)
        self.max_adapter_bytes = max_adapter_bytes
        self.max_partial_bytes = max_partial_bytes
        self.max_uploads = max_uploads
        self.max_gateway_uploads = max_gateway_uploads
        self._uploads: dict[str, _Upload] = {}
        self._reserved = 0
        self._of_gateway: Counter[bytes] = Counter()
        """Uploads under way per gateway (routing id)."""
        self.abandoned_seconds = ABANDONED_SECONDS
        self._removals: set[asyncio.Task[None]] = set()
        """Dropped uploads' folders being removed (`_remove`)."""
        self._waiting: Counter[tuple[bytes, str]] = Counter()
        """(gateway, digest) of the first parts waiting for another gateway's upload."""
        self._waiting_of: Counter[bytes] = Counter()
        """Those first parts per gateway: each holds its part in memory while it waits."""
        self._aborted: Counter[tuple[bytes, str]] = Counter()
        """Of those, how many their gateway aborted meanwhile (`abort`): they start nothing.
        A count, not a flag: a gateway's second aborted first part of one digest was lost in a
        set, and started an upload nobody continued."""
        self._reserved_of: Counter[bytes] = Counter()
        """Bytes announced by each gateway's uploads under way: at most `max_gateway_bytes`
        (half the engine's by default), so one gateway cannot hold the whole budget, and
        refuse every other gateway's uploads."""
        self.max_gateway_bytes = (
            max_partial_bytes // 2 if max_gateway_bytes is None else max_gateway_bytes
        )
        self.wait_seconds = WAIT_SECONDS

    @property
    def reserved(self) -> int:
        """The bytes the uploads under way announced, together."""
        return self._reserved

    async def wait_turn(self, gateway: bytes, digest: str) -> bool:
        """Wait while another gateway's upload of `digest` (or one being registered) is under
        way; whether it waited (then the digest may be served already). Refused
        (InvalidRequestError) when `gateway` aborted its upload meanwhile, and as overloaded
        past `max_gateway_uploads` first parts of one gateway waiting (each holds its part in
        memory while it waits)."""
        waited, key = False, (gateway, digest)
        while (upload := self._uploads.get(digest)) is not None and (
            upload.gateway != gateway or upload.complete
        ):
            if self._waiting_of[gateway] >= self.max_gateway_uploads:
                raise EngineOverloadedError(
                    f"this gateway has {self.max_gateway_uploads} adapter uploads waiting here"
                )
            self._waiting[key] += 1
            self._waiting_of[gateway] += 1
            try:
                async with asyncio.timeout(self.wait_seconds):
                    await upload.ended.wait()
            except TimeoutError:
                raise EngineOverloadedError(
                    "another upload of this adapter is still under way here; retry"
                ) from None
            finally:
                self._waiting -= Counter({key: 1})  # drops counts that reach 0
                self._waiting_of -= Counter({gateway: 1})
                aborted = self._aborted[key] > 0
                self._aborted -= Counter({key: 1})
            if aborted:
                raise InvalidRequestError("the gateway aborted this upload")
            waited = True
        return waited

    async def receive(
        self,
        gateway: bytes,
        digest: str,
        config: bytes | None,
        part: bytes,
        offset: int,
        size: int,
    ) -> Path | None:
        """Store one part of `gateway`'s upload of `digest` (a first part after `wait_turn`);
        the folder holding the whole adapter once this part completes it (the caller registers
        it, removes the folder, then calls `finish`), else None. Typed errors for a part out of
        order or over the bounds (the gateway's upload is then dropped)."""
        if offset == 0:
            upload: _Upload | None = self._start(gateway, digest, config, size)
        else:
            upload = self._own(gateway, digest)
        if upload is None or upload.size != size:
            self._drop_own(gateway, digest)
            raise InvalidRequestError("an adapter part came with no upload under way for it")
        async with upload.lock:
            if self._own(gateway, digest) is not upload or upload.received != offset:
                self._drop_own(gateway, digest)
                raise InvalidRequestError(f"an adapter part came out of order (at {offset})")
            if offset + len(part) > size:
                self._drop(digest)
                raise InvalidRequestError("an adapter part goes past the size it announced")
            if not part and offset:
                # It would postpone the upload's abandonment without adding a byte.
                self._drop(digest)
                raise InvalidRequestError("an adapter part holds no bytes")
            await self._write(digest, upload, config or b"", part)
            if upload.retired:
                raise UnknownAdapterError("the adapter was retired while it was uploaded")
            if self._uploads.get(digest) is not upload:
                raise InvalidRequestError("the upload was dropped (started anew, or abandoned)")
            upload.received += len(part)
            if upload.received < size:
                self._keep(digest, upload)
                return None
            if upload.timer is not None:
                upload.timer.cancel()
            upload.complete = True
            return upload.folder

    def finish(self, digest: str) -> None:
        """The complete upload of `digest` is registered (or refused) and its folder removed:
        no longer under way, its share free."""
        upload = self._uploads.get(digest)
        if upload is not None and upload.complete:
            self._forget(digest)

    def abort(self, gateway: bytes, digest: str) -> None:
        """`gateway` gave up its upload of `digest` (its request was cancelled, or failed): it
        is dropped now rather than once abandoned, and a first part of it still waiting for
        another gateway's upload starts nothing."""
        key = (gateway, digest)
        if self._waiting[key] > self._aborted[key]:
            self._aborted[key] += 1
        self._drop_own(gateway, digest)

    def _own(self, gateway: bytes, digest: str) -> _Upload | None:
        """`gateway`'s upload of `digest` while its parts are still coming."""
        upload = self._uploads.get(digest)
        ours = upload is not None and upload.gateway == gateway and not upload.complete
        return upload if ours else None

    def _drop_own(self, gateway: bytes, digest: str) -> None:
        if self._own(gateway, digest) is not None:
            self._drop(digest)

    def _start(self, gateway: bytes, digest: str, config: bytes | None, size: int) -> _Upload:
        """A new upload of `digest` (replacing the gateway's own under way; another's is
        waited for first: `wait_turn`), its config written."""
        self._drop_own(gateway, digest)
        if digest in self._uploads:
            raise InvalidRequestError("another upload of this adapter is under way")
        if config is None:
            raise InvalidRequestError("an upload's first part carries the adapter's config")
        if len(config) > MAX_CONFIG_BYTES or len(config) + size > self.max_adapter_bytes:
            raise FileTooLarge(
                f"the adapter's files hold {len(config) + size} bytes; this engine takes "
                f"adapters of at most {self.max_adapter_bytes} bytes (and a config of at most "
                f"{MAX_CONFIG_BYTES})"
            )
        if (
            self._reserved + len(config) + size > self.max_partial_bytes
            or len(self._uploads) >= self.max_uploads
        ):
            raise EngineOverloadedError(
                "the engine has as many adapter uploads under way as it takes"
            )
        if self._of_gateway[gateway] >= self.max_gateway_uploads:
            raise EngineOverloadedError(
                f"this gateway has {self.max_gateway_uploads} adapter uploads under way here"
            )
        if self._reserved_of[gateway] + len(config) + size > self.max_gateway_bytes:
            raise EngineOverloadedError(
                "this gateway's adapter uploads under way here hold its share of the engine's"
            )
        upload = self._uploads[digest] = _Upload(gateway, size, len(config) + size)
        self._reserved += upload.reserved
        self._reserved_of[gateway] += upload.reserved
        self._of_gateway[gateway] += 1
        self._keep(digest, upload)
        return upload

    async def _write(self, digest: str, upload: _Upload, config: bytes, part: bytes) -> None:
        """Write a part (its first one makes the upload's folder, with the config), off the
        event loop. Files gone under an upload still under way are the engine's fault, not the
        adapter's (AdapterUnavailableError: the gateway retries); an upload dropped meanwhile
        lost its folder with it, and its caller refuses the part."""
        try:
            if upload.folder is None:
                upload.folder = await asyncio.to_thread(_create, self.folder, config)
            await asyncio.to_thread(_append, upload.folder, part)
        except FileNotFoundError:
            if self._uploads.get(digest) is upload:
                self._drop(digest)
                raise AdapterUnavailableError(
                    "this upload's files went missing on the engine; retry"
                ) from None

    def cancel(self, digest: str) -> None:
        """Drop the upload of `digest` under way: it is being retired (its tenant deleted it),
        and an upload finished after the retire would serve it, and keep its files, for good.
        Its next part is refused. (One being registered is retired by its caller.)"""
        upload = self._uploads.get(digest)
        if upload is not None and not upload.complete:
            upload.retired = True
            self._drop(digest)

    def _keep(self, digest: str, upload: _Upload) -> None:
        """(Re)start the upload's abandonment timer."""
        if upload.timer is not None:
            upload.timer.cancel()
        loop = asyncio.get_running_loop()
        upload.timer = loop.call_later(self.abandoned_seconds, self._abandon, digest, upload)

    def _abandon(self, digest: str, upload: _Upload) -> None:
        if self._uploads.get(digest) is upload:
            self._drop(digest)

    def _forget(self, digest: str) -> _Upload | None:
        """No longer under way (its files stay)."""
        upload = self._uploads.pop(digest, None)
        if upload is not None:
            self._reserved -= upload.reserved
            self._reserved_of -= Counter({upload.gateway: upload.reserved})
            self._of_gateway[upload.gateway] -= 1
            if not self._of_gateway[upload.gateway]:
                del self._of_gateway[upload.gateway]
            if upload.timer is not None:
                upload.timer.cancel()
            upload.ended.set()
        return upload

    def _drop(self, digest: str) -> None:
        """No longer under way, and its files removed (soon: `_remove`)."""
        upload = self._forget(digest)
        if upload is not None:
            removal = asyncio.get_running_loop().create_task(self._remove(upload))
            self._removals.add(removal)
            removal.add_done_callback(self._removals.discard)

    async def _remove(self, upload: _Upload) -> None:
        """Remove a dropped upload's folder once no part of it is being written (under its
        lock) and off the event loop: removed while a part's write ran on its thread, the
        folder lost its file, the write made it again, and the folder stayed for good."""
        async with upload.lock:
            if upload.folder is not None:
                await asyncio.to_thread(shutil.rmtree, upload.folder, True)

    async def settled(self) -> None:
        """Return once the folders of the uploads dropped so far are removed."""
        while self._removals:
            await asyncio.gather(*self._removals, return_exceptions=True)

    def close(self) -> None:
        for removal in self._removals:
            removal.cancel()
        for key in list(self._uploads):
            upload = self._forget(key)
            if upload is not None and upload.folder is not None:
                shutil.rmtree(upload.folder, ignore_errors=True)


def _create(root: Path, config: bytes) -> Path:
    """A new upload's folder under `root`, its config written and its weights file empty."""
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=root))
    (folder / CONFIG_FILE).write_bytes(config)
    (folder / WEIGHTS_FILE).touch()
    return folder


def _append(folder: Path, data: bytes) -> None:
    """Append to an upload's weights file; FileNotFoundError once its upload was dropped (the
    file is never created here: a part written after its folder went does not make it again),
    or when its config is gone."""
    fd = os.open(folder / WEIGHTS_FILE, os.O_WRONLY | os.O_APPEND)
    with os.fdopen(fd, "ab") as file:
        file.write(data)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_FILE} is gone")
