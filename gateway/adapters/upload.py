"""Receive an adapter upload (multipart/form-data) by streaming it to files in a work folder.

The body is parsed as it arrives, and file parts go straight to disk under names chosen here
(never the client's filename), so an upload of any size holds only a chunk in memory. The
declared Content-Length and then the bytes actually received are held to `max_bytes` (413).
Accepted parts: `name` and `owner` (short text) and either `archive` or both `adapter_config`
and `adapter_model`; any other part, a repeated part or a malformed body is a 400.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from litestar import Request
from multipart import MultipartError, MultipartSegment, PushMultipartParser

from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loramux.gateway.errors import BadRequest, PayloadTooLarge

UPLOADS_FOLDER = "uploads"
"""Where uploads are received, in the data directory (one workspace each)."""
TEXT_PARTS = ("name", "owner")
MAX_TEXT_BYTES = 1024
ADAPTER_FOLDER = "adapter"
_FILE_PARTS = {
    "archive": Path("upload.archive"),
    "adapter_config": Path(ADAPTER_FOLDER) / CONFIG_FILE,
    "adapter_model": Path(ADAPTER_FOLDER) / WEIGHTS_FILE,
}


@dataclass(frozen=True)
class UploadSpace:
    """Where uploads are received and how large one may be (LORAMUX_MAX_UPLOAD_MB)."""

    root: Path
    max_bytes: int


@dataclass(frozen=True)
class AdapterUpload:
    """A received upload: `archive` is set, or `folder` holds the two adapter files."""

    name: str
    owner: str
    archive: Path | None
    folder: Path | None


@contextmanager
def workspace(root: Path) -> Iterator[Path]:
    """A fresh folder under `root` for one upload, removed with everything in it on exit."""
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="upload-") as work:
        yield Path(work)


async def receive_upload(
    request: Request[Any, Any, Any], work: Path, max_bytes: int
) -> AdapterUpload:
    """Stream the request's multipart body into `work` (an empty folder)."""
    boundary = _boundary(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    form = _Form(work)
    received = 0
    try:
        with PushMultipartParser(boundary, max_segment_count=8) as parser:
            async for chunk in request.stream():
                received += len(chunk)
                if received > max_bytes:
                    raise _too_large(max_bytes)
                for event in parser.parse(chunk):
                    form.feed(event)
    except MultipartError as exc:
        raise _bad(f"malformed multipart body: {exc}", "body") from None
    finally:
        form.close()
    return form.result()


def _boundary(request: Request[Any, Any, Any]) -> str:
    media_type, options = request.content_type
    boundary = options.get("boundary")
    if media_type != "multipart/form-data" or not boundary:
        raise _bad("upload an adapter as multipart/form-data", "body")
    return boundary


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="invalid_upload")


def _too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the upload is larger than {max_bytes >> 20} MiB", code="file_too_large"
    )


@dataclass
class _Form:
    """The parts received so far; the open file of the part being received, if it is a file."""

    work: Path
    text: dict[str, bytearray] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    _part: str | None = None
    _sink: IO[bytes] | None = None

    def feed(self, event: MultipartSegment | bytes | bytearray | None) -> None:
        if isinstance(event, MultipartSegment):
            self._start(event.name or "")
        elif event is None:
            self.close()
            self._part = None
        elif self._sink is not None:
            self._sink.write(event)
        else:
            assert self._part is not None, "data arrives only inside a part"
            value = self.text[self._part]
            value += event
            if len(value) > MAX_TEXT_BYTES:
                raise _bad(f"the field {self._part!r} is too long", self._part)

    def _start(self, name: str) -> None:
        if name in self.text or name in self.files:
            raise _bad(f"the field {name!r} appears twice", name)
        self._part = name
        if name in TEXT_PARTS:
            self.text[name] = bytearray()
        elif name in _FILE_PARTS:
            path = self.work / _FILE_PARTS[name]
            path.parent.mkdir(exist_ok=True)
            self.files[name] = path
            self._sink = path.open("xb")
        else:
            raise _bad(
                f"unexpected field {name!r}; send name, owner and either archive or "
                "adapter_config and adapter_model",
                name,
            )

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def result(self) -> AdapterUpload:
        missing = [name for name in TEXT_PARTS if not self.text.get(name)]
        if missing:
            raise _bad(f"the field {missing[0]!r} is required", missing[0])
        name, owner = (self._decode(n) for n in TEXT_PARTS)
        pair = [n for n in ("adapter_config", "adapter_model") if n in self.files]
        if ("archive" in self.files) == bool(pair) or len(pair) == 1:
            raise _bad("send either an archive or both adapter_config and adapter_model", "archive")
        if "archive" in self.files:
            return AdapterUpload(name, owner, self.files["archive"], None)
        return AdapterUpload(name, owner, None, self.work / ADAPTER_FOLDER)

    def _decode(self, name: str) -> str:
        try:
            return self.text[name].decode("utf-8").strip()
        except UnicodeDecodeError:
            raise _bad(f"the field {name!r} is not UTF-8", name) from None
