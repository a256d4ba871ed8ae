"""Safe extraction of an uploaded adapter archive (.zip or .tar.gz).

An archive is untrusted input. The rules, checked on the archive's own listing before a
byte is extracted and again while extracting:
- at most `max_entries` entries; only regular files and folders (no symbolic or hard
  links, devices, FIFOs, encrypted zip entries);
- names are relative POSIX paths without `..`, backslashes or drive letters;
- files are only adapter_config.json, adapter_model.safetensors and README.md, each at most
  once, all at the top level or all inside one top-level folder;
- the total extracted size stays under `max_total_bytes` (counted while streaming, so a
  lying header cannot exceed it) and the expansion over the archive size under `max_ratio`
  once past a megabyte (a zip bomb is refused early, whatever its declared sizes).
Nothing is parsed or inflated beyond what those limits allow: a zip's entry count and
directory size are checked from its end record before zipfile reads the directory, a tar
member's size as soon as its header is read (tarfile skips a member by inflating it), and
every byte of a tar's gzip stream is charged to the budget before it is inflated.
Bytes that are no readable archive are an InvalidArchive, whatever the decompressor raises.
Files are written under the destination by their allowed base name only: an archive path
never becomes a filesystem path.
"""

from __future__ import annotations

import gzip
import io
import lzma
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import IO

from loramux.adapters.errors import FileTooLarge, InvalidArchive, UnsafeArchive

ALLOWED_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors", "README.md"})
_RATIO_FLOOR_BYTES = 1 << 20
_CHUNK = 1 << 20
_TAR_HEADER_ROOM = 1 << 20
"""Inflated tar bytes allowed beyond the files' limits: each entry's header, pax or GNU
long-name records and padding, and the end-of-archive blocks (a few KiB in practice)."""


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on an uploaded archive's content."""

    max_entries: int = 8
    """Files and folders together."""
    max_total_bytes: int = (1 << 30) + (1 << 20)
    """Extracted bytes over all files: the largest adapter file plus room for the rest."""
    max_ratio: float = 200.0
    """Extracted bytes per archive byte, enforced once past a megabyte extracted."""


@dataclass(frozen=True)
class _Entry:
    """One archive member that passed the listing checks."""

    name: str
    is_dir: bool
    size: int
    open: Callable[[], IO[bytes]]


def extract_adapter_archive(archive: Path, dest: Path, limits: ArchiveLimits | None = None) -> Path:
    """Extract the adapter files of `archive` into the existing empty folder `dest`; return `dest`.

    Raises UnsafeArchive, FileTooLarge or InvalidArchive; on error `dest` may hold partial
    files, so callers extract into a temporary folder they remove.
    """
    limits = limits or ArchiveLimits()
    budget = _Budget(limits, archive.stat().st_size)
    with _entries(archive, budget) as entries:
        files = _check_listing(entries)
        for entry in files:
            target = dest / PurePosixPath(entry.name).name
            with entry.open() as source, target.open("xb") as sink:
                _copy_limited(source, sink, budget)
    return dest


_UNREADABLE = (
    zipfile.BadZipFile,
    tarfile.TarError,
    EOFError,  # a truncated gzip or zip stream
    OSError,  # gzip.BadGzipFile, a corrupt bzip2 stream
    zlib.error,  # a corrupt deflate stream, in a zip entry or in the gzip
    lzma.LZMAError,  # a corrupt LZMA zip entry
    NotImplementedError,  # a zip compression method zipfile lacks (Deflate64, …)
    UnicodeDecodeError,  # a zip entry name flagged UTF-8 that is not
)
"""What zipfile, tarfile and the decompressors raise for bytes that are no readable archive."""


@contextmanager
def _entries(archive: Path, budget: _Budget) -> Iterator[list[_Entry]]:
    """The members of a zip or gzip'ed tar, refusing early when there are too many or they
    declare more bytes than the budget allows (the body of the `with` is covered too: an
    entry that cannot be read while extracting is an InvalidArchive as well)."""
    with archive.open("rb") as handle:
        magic = handle.read(2)
        if magic == b"PK":
            _check_zip_directory(handle, budget.limits.max_entries)
    try:
        if magic == b"PK":
            with zipfile.ZipFile(archive) as zipped:
                yield _zip_entries(zipped, budget)
        elif magic == b"\x1f\x8b":
            with (
                gzip.GzipFile(archive, "rb") as inflated,
                tarfile.open(fileobj=_MeteredStream(inflated, budget), mode="r:") as tarred,
            ):
                yield _tar_entries(tarred, budget)
        else:
            raise InvalidArchive("the archive must be a .zip or a .tar.gz")
    except _UNREADABLE as error:
        raise InvalidArchive(f"the archive cannot be read: {error}") from None


def _zip_entries(zipped: zipfile.ZipFile, budget: _Budget) -> list[_Entry]:
    infos = zipped.infolist()
    _check_count(len(infos), budget.limits.max_entries)
    entries = []
    for info in infos:
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0 when the zip was made without one
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise UnsafeArchive(f"{info.filename!r} is a link or special file")
        if info.flag_bits & 0x1:
            raise UnsafeArchive(f"{info.filename!r} is encrypted")
        if not info.is_dir():
            budget.declare(info.file_size)
        entries.append(
            _Entry(info.filename, info.is_dir(), info.file_size, partial(zipped.open, info))
        )
    return entries


def _tar_entries(tarred: tarfile.TarFile, budget: _Budget) -> list[_Entry]:
    """The members, each checked as its header is read: `next()` skips the previous member's
    body by inflating it, so a member refused here is never inflated."""
    entries: list[_Entry] = []
    while (member := tarred.next()) is not None:
        _check_count(len(entries) + 1, budget.limits.max_entries)
        if not (member.isreg() or member.isdir()):
            raise UnsafeArchive(f"{member.name!r} is a link or special file")
        if member.isreg():  # a folder's size field is not read, so it is not counted
            budget.declare(member.size)
        opener = partial(_tar_open, tarred, member)
        entries.append(_Entry(member.name, member.isdir(), member.size, opener))
    return entries


def _tar_open(tarred: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    source = tarred.extractfile(member)
    assert source is not None, "regular members always have content"
    return source


_EOCD = struct.Struct("<4s4H2LH")
"""Zip's end-of-central-directory record: signature, two disk numbers, the entries on this
disk and in all, the directory's size and offset, the comment's length."""
_EOCD_SIGNATURE = b"PK\x05\x06"
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
"""Zip64's locator, just before the end record: signature, disk, the zip64 record's offset,
disks."""
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
"""Zip64's end record: signature, size, two versions, two disk numbers, the entries on this
disk and in all, the directory's size and offset."""
_MAX_COMMENT = 0xFFFF
_MAX_CENTRAL_ENTRY = 46 + 3 * 0xFFFF
"""The most one central-directory entry can take: its fixed part, then a name, an extra
field and a comment of at most 64 KiB each."""


def _check_zip_directory(handle: IO[bytes], max_entries: int) -> None:
    """Refuse a zip whose end record declares more than `max_entries` entries, or a central
    directory larger than that many entries can fill, before zipfile reads the directory.

    zipfile parses a directory of whatever size the end record gives, one object per entry,
    and ignores the declared count: a 47 MB zip of a million entries took 270 MiB before the
    count was checked. Each record zipfile may take for the end record is checked (one
    ending the file, the last signature in the comment's reach), with every zip64 record it
    may point to; a 16- or 32-bit field that only says "see zip64" is then left out.
    """
    size = handle.seek(0, 2)
    start = max(size - _EOCD.size - _MAX_COMMENT, 0)
    handle.seek(start)
    tail = handle.read()
    candidates = {tail.rfind(_EOCD_SIGNATURE), len(tail) - _EOCD.size}
    for at in sorted(at for at in candidates if at >= 0):
        record = tail[at : at + _EOCD.size]
        if len(record) != _EOCD.size or not record.startswith(_EOCD_SIGNATURE):
            continue
        _, _, _, on_disk, total, directory_bytes, _, _ = _EOCD.unpack(record)
        declared = _zip64_records(handle, start + at)
        if declared:  # then 0xFFFF and 0xFFFFFFFF in the classic record mean "see zip64"
            on_disk, total = (0 if count == 0xFFFF else count for count in (on_disk, total))
            directory_bytes = 0 if directory_bytes == 0xFFFFFFFF else directory_bytes
        declared.append((max(on_disk, total), directory_bytes))
        for entries, bytes_ in declared:
            _check_count(entries, max_entries)
            if bytes_ > max_entries * _MAX_CENTRAL_ENTRY:
                raise UnsafeArchive(
                    f"the archive's directory is {bytes_} bytes, more than {max_entries} "
                    "entries can fill"
                )


def _zip64_records(handle: IO[bytes], end_record_at: int) -> list[tuple[int, int]]:
    """(entries, directory bytes) of each zip64 end record that the locator before the end
    record at `end_record_at` leads to: zipfile reads the one right before the locator, and
    the locator also gives an offset."""
    if end_record_at < _EOCD64_LOCATOR.size:
        return []
    handle.seek(end_record_at - _EOCD64_LOCATOR.size)
    signature, _, offset, _ = _EOCD64_LOCATOR.unpack(handle.read(_EOCD64_LOCATOR.size))
    if signature != b"PK\x06\x07":
        return []
    records = []
    for at in {end_record_at - _EOCD64_LOCATOR.size - _EOCD64.size, offset}:
        if 0 <= at <= end_record_at - _EOCD64.size:
            handle.seek(at)
            fields = _EOCD64.unpack(handle.read(_EOCD64.size))
            if fields[0] == b"PK\x06\x06":
                records.append((max(fields[6], fields[7]), fields[8]))
    return records


def _check_count(count: int, max_entries: int) -> None:
    if count > max_entries:
        raise UnsafeArchive(f"the archive has more than {max_entries} entries")


def _check_listing(entries: list[_Entry]) -> list[_Entry]:
    """The file entries, after checking names, the allowed set and the single-folder rule."""
    files, parents, seen = [], set(), set()
    for entry in entries:
        path = _safe_path(entry.name)
        if entry.is_dir:
            if len(path.parts) > 1:
                raise UnsafeArchive(f"{entry.name!r}: only one top-level folder is allowed")
            continue
        if path.name not in ALLOWED_FILES:
            raise UnsafeArchive(
                f"{entry.name!r} is not an adapter file; an archive may hold only "
                f"{', '.join(sorted(ALLOWED_FILES))}"
            )
        if path.name in seen:
            raise UnsafeArchive(f"{path.name} appears twice in the archive")
        if len(path.parts) > 2:
            raise UnsafeArchive(f"{entry.name!r} is nested too deep")
        seen.add(path.name)
        parents.add(path.parent)
        files.append(entry)
    if len(parents) > 1:
        raise UnsafeArchive("the adapter files must all be in the same folder")
    return files


def _safe_path(name: str) -> PurePosixPath:
    """A relative path inside the archive's root, or UnsafeArchive."""
    if not name or "\\" in name or "\x00" in name or name.startswith("/") or ":" in name:
        raise UnsafeArchive(f"{name!r} is not a safe relative path")
    path = PurePosixPath(name)  # drops "." components, as in "./adapter_config.json"
    if ".." in path.parts:
        raise UnsafeArchive(f"{name!r} leaves the archive's folder")
    return path


class _Budget:
    """Bytes declared, extracted and (for a tar) inflated so far against the size and
    expansion-ratio limits."""

    def __init__(self, limits: ArchiveLimits, archive_bytes: int) -> None:
        self.limits = limits
        self.archive_bytes = max(archive_bytes, 1)
        self.declared = 0
        self.extracted = 0
        self.inflated = 0

    def declare(self, size: int) -> None:
        """Count a file's size from its header, before any of it is read."""
        self.declared += size
        self._check(self.declared)

    def spend(self, size: int) -> None:
        """Count bytes extracted (headers can lie; the stream cannot)."""
        self.extracted += size
        self._check(self.extracted)

    def inflate(self, end: int) -> None:
        """Count a tar stream inflated up to offset `end`, before it is: its headers and
        padding get _TAR_HEADER_ROOM on top of what the files may hold."""
        if end > self.inflated:
            self.inflated = end
            self._check(max(end - _TAR_HEADER_ROOM, 0))

    def _check(self, total: int) -> None:
        if total > self.limits.max_total_bytes:
            raise FileTooLarge(
                f"the archive expands to more than {self.limits.max_total_bytes} bytes"
            )
        ratio = total / self.archive_bytes
        if total > _RATIO_FLOOR_BYTES and ratio > self.limits.max_ratio:
            raise FileTooLarge(
                f"the archive expands {ratio:.0f}-fold, over {self.limits.max_ratio}"
            )


def _copy_limited(source: IO[bytes], sink: IO[bytes], budget: _Budget) -> None:
    """Copy, counting every byte against the budget (headers can lie; the stream cannot)."""
    while chunk := source.read(_CHUNK):
        budget.spend(len(chunk))
        sink.write(chunk)


class _MeteredStream(io.RawIOBase):
    """The inflated tar stream, charging the budget for each read or seek before the gzip
    stream inflates it.

    tarfile skips a member by seeking past it, which a gzip stream does by inflating, and
    reads a pax or GNU long-name record whole into memory at the size its header declares;
    neither passes `_copy_limited`. Charging the furthest offset reached means re-reading
    from the start (extracting after the listing) is not charged twice: it inflates at most
    what the listing did.
    """

    def __init__(self, inflated: gzip.GzipFile, budget: _Budget) -> None:
        super().__init__()
        self.inflated = inflated
        self.budget = budget

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            return b"".join(iter(partial(self.read, _CHUNK), b""))
        self.budget.inflate(self.inflated.tell() + size)
        return self.inflated.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        assert whence == 0, "tarfile seeks to absolute offsets"
        self.budget.inflate(offset)
        return self.inflated.seek(offset)

    def tell(self) -> int:
        return self.inflated.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True
