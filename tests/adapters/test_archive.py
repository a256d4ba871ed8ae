"""Uploaded adapter archives: a well-formed one extracts, anything unsafe is refused."""

from __future__ import annotations

import gzip
import io
import stat
import struct
import tarfile
import zipfile
from pathlib import Path

import pytest

from loramux.adapters.archive import ArchiveLimits, extract_adapter_archive
from loramux.adapters.errors import AdapterError
from loramux.adapters.peft_format import load_peft_adapter
from tests.adapters.peft_adapters import make_peft_adapter, tiny_base

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tmp_path_factory.mktemp("peft") / "adapter")


def members(folder: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + name: (folder / name).read_bytes() for name in ADAPTER_FILES}


def write_zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def write_tar(path: Path, files: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for info in extra:
            archive.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def refusal(archive: Path, dest: Path, limits: ArchiveLimits | None = None) -> str:
    dest.mkdir(exist_ok=True)
    with pytest.raises(AdapterError) as raised:
        extract_adapter_archive(archive, dest, limits)
    return raised.value.code


def test_zip_of_the_files_extracts_and_loads(adapter_folder: Path, tmp_path: Path) -> None:
    archive = write_zip(tmp_path / "a.zip", members(adapter_folder))
    (tmp_path / "out").mkdir()
    out = extract_adapter_archive(archive, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == sorted(ADAPTER_FILES)
    expected = load_peft_adapter(adapter_folder, tiny_base()).digest
    assert load_peft_adapter(out, tiny_base()).digest == expected


@pytest.mark.parametrize("prefix", ["my-adapter/", "./"])
def test_tar_gz_with_one_top_folder_extracts(
    adapter_folder: Path, tmp_path: Path, prefix: str
) -> None:
    folder_entry = special(prefix.rstrip("/") or ".", tarfile.DIRTYPE)
    archive = write_tar(tmp_path / "a.tar.gz", members(adapter_folder, prefix), [folder_entry])
    (tmp_path / "out").mkdir()
    out = extract_adapter_archive(archive, tmp_path / "out")
    assert (out / "adapter_model.safetensors").read_bytes() == (
        adapter_folder / "adapter_model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    "entry",
    [
        special("adapter_model.safetensors", tarfile.SYMTYPE, "/etc/passwd"),
        special("adapter_config.json", tarfile.LNKTYPE, "README.md"),
        special("README.md", tarfile.CHRTYPE),
        special("README.md", tarfile.FIFOTYPE),
    ],
    ids=["symlink", "hardlink", "device", "fifo"],
)
def test_tar_links_and_special_files(tmp_path: Path, entry: tarfile.TarInfo) -> None:
    archive = write_tar(tmp_path / "a.tar.gz", {}, [entry])
    assert refusal(archive, tmp_path / "out") == "unsafe_archive"


def test_zip_symlink(adapter_folder: Path, tmp_path: Path) -> None:
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        link = zipfile.ZipInfo("adapter_model.safetensors")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zipped.writestr(link, "/etc/passwd")
    assert refusal(archive, tmp_path / "out") == "unsafe_archive"


@pytest.mark.parametrize(
    "name",
    [
        "/abs/adapter_config.json",
        "../adapter_config.json",
        "a/../../adapter_config.json",
        "a\\adapter_config.json",
        "C:adapter_config.json",
        "a/b/adapter_config.json",
        "adapter_model.bin",
        "evil.py",
        "__MACOSX/._README.md",
    ],
)
def test_paths_and_names_outside_the_adapter(
    adapter_folder: Path, tmp_path: Path, name: str
) -> None:
    files = members(adapter_folder)
    files.pop(name.rsplit("/", 1)[-1], None)  # so that only the bad name can be the reason
    files[name] = b"{}"
    archive = write_zip(tmp_path / "a.zip", files)
    assert refusal(archive, tmp_path / "out") == "unsafe_archive"
    assert not any((tmp_path / "out").iterdir())


def test_files_split_over_folders(adapter_folder: Path, tmp_path: Path) -> None:
    files = members(adapter_folder, "one/")
    files["two/README.md"] = files.pop("one/README.md")
    assert refusal(write_zip(tmp_path / "a.zip", files), tmp_path / "out") == "unsafe_archive"


def test_duplicate_files(adapter_folder: Path, tmp_path: Path) -> None:
    files = members(adapter_folder) | {"x/README.md": b"again"}
    assert refusal(write_tar(tmp_path / "a.tar.gz", files), tmp_path / "out") == "unsafe_archive"


def test_too_many_entries(adapter_folder: Path, tmp_path: Path) -> None:
    folders = [special(f"d{i}", tarfile.DIRTYPE) for i in range(6)]
    archive = write_tar(tmp_path / "a.tar.gz", members(adapter_folder), folders)
    assert refusal(archive, tmp_path / "out") == "unsafe_archive"


def test_zip_bomb_is_refused_by_ratio(tmp_path: Path) -> None:
    archive = write_zip(tmp_path / "a.zip", {"adapter_model.safetensors": bytes(4 << 20)})
    assert refusal(archive, tmp_path / "out", ArchiveLimits(max_ratio=50)) == "file_too_large"


def test_total_size_limit(adapter_folder: Path, tmp_path: Path) -> None:
    archive = write_zip(tmp_path / "a.zip", members(adapter_folder))
    assert (
        refusal(archive, tmp_path / "out", ArchiveLimits(max_total_bytes=1000)) == "file_too_large"
    )


@pytest.mark.parametrize(
    "content", [b"not an archive at all", b"PK\x03\x04broken", b"\x1f\x8bbroken"]
)
def test_unreadable_archives(tmp_path: Path, content: bytes) -> None:
    archive = tmp_path / "a.zip"
    archive.write_bytes(content)
    assert refusal(archive, tmp_path / "out") == "invalid_archive"


def tar_gz_of_headers(*headers: tarfile.TarInfo) -> bytes:
    """A .tar.gz that ends right after these headers: any body they declare is missing, so
    an extraction that reads or skips one finds the archive truncated (invalid_archive)."""
    return gzip.compress(b"".join(info.tobuf(format=tarfile.GNU_FORMAT) for info in headers))


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info


@pytest.mark.parametrize(
    "headers",
    [
        [header("adapter_model.safetensors", 4 << 30)],
        [header("adapter_config.json", 0), header("adapter_model.safetensors", 4 << 30)],
        [header("adapter_model.safetensors", 512 << 20)],
        [header("././@PaxHeader", 512 << 20, tarfile.XHDTYPE)],
        [header("././@LongLink", 512 << 20, tarfile.GNUTYPE_LONGNAME)],
    ],
    ids=["over the total", "second member", "over the ratio", "pax record", "GNU long name"],
)
def test_tar_sizes_are_refused_at_their_header(
    tmp_path: Path, headers: list[tarfile.TarInfo]
) -> None:
    """A tar header declaring more bytes than the limits allow (over the total, or a
    500,000-fold expansion of this small archive) is refused before any of them is
    inflated: the bodies are missing here, and reading one would call the archive truncated.
    tarfile skips a member by inflating its body and reads a pax or long-name record whole
    into memory; the sizes were checked only after the listing had skipped every member, so
    a 4 MB .tar.gz declaring 4 GiB inflated 4 GiB (9-15 s of CPU) before its refusal."""
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(tar_gz_of_headers(*headers))
    assert refusal(archive, tmp_path / "out") == "file_too_large"


@pytest.mark.parametrize("method", [9, 97], ids=["deflate64", "unknown"])
def test_zip_compression_methods_zipfile_lacks(
    adapter_folder: Path, tmp_path: Path, method: int
) -> None:
    """An entry compressed by a method zipfile cannot read is an invalid archive; it was a
    NotImplementedError (an HTTP 500)."""
    raw = bytearray(write_zip(tmp_path / "a.zip", members(adapter_folder)).read_bytes())
    for signature, method_at in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        at = -1
        while (at := raw.find(signature, at + 1)) >= 0:
            raw[at + method_at : at + method_at + 2] = struct.pack("<H", method)
    (tmp_path / "a.zip").write_bytes(raw)
    assert refusal(tmp_path / "a.zip", tmp_path / "out") == "invalid_archive"


@pytest.mark.parametrize(
    ("method", "garbage_at"),
    [(zipfile.ZIP_DEFLATED, 0), (zipfile.ZIP_LZMA, 9)],  # LZMA: after its 9-byte header
    ids=["deflate", "lzma"],
)
def test_zip_with_a_corrupt_compressed_stream(
    adapter_folder: Path, tmp_path: Path, method: int, garbage_at: int
) -> None:
    """An entry whose compressed stream does not decompress is an invalid archive; it was a
    zlib.error or an LZMAError (an HTTP 500)."""
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w", compression=method) as zipped:
        zipped.writestr(
            "adapter_config.json", (adapter_folder / "adapter_config.json").read_bytes()
        )
    raw = bytearray(archive.read_bytes())
    at = 30 + len("adapter_config.json") + garbage_at  # the local header, then the data
    raw[at : at + 16] = b"\xff" * 16  # deflate: block type 3, "invalid block type"
    archive.write_bytes(raw)
    assert refusal(archive, tmp_path / "out") == "invalid_archive"


def test_zip_name_flagged_utf8_that_is_not(tmp_path: Path) -> None:
    """An entry name flagged UTF-8 (bit 11) that does not decode is an invalid archive; it was
    a UnicodeDecodeError, which the gateway took for a request body that is not UTF-8."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zipped:
        zipped.writestr("README.mX", b"hello")
    raw = bytearray(buffer.getvalue().replace(b"README.mX", b"README.\xff\xfe"))
    for signature, flags_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = raw.find(signature) + flags_at
        flags = struct.unpack("<H", raw[at : at + 2])[0] | 0x800
        raw[at : at + 2] = struct.pack("<H", flags)
    (tmp_path / "a.zip").write_bytes(raw)
    assert refusal(tmp_path / "a.zip", tmp_path / "out") == "invalid_archive"


def zip_declaring(entries: int, directory_bytes: int, zip64: bool = False) -> bytes:
    """A zip whose end record declares `entries` entries in a central directory of
    `directory_bytes` bytes, which are zeros: zipfile, reading it, would find no entry there
    and call the archive invalid. With `zip64`, the counts are in a zip64 end record and the
    classic one holds the "see zip64" placeholders."""
    directory = bytes(directory_bytes)
    if not zip64:
        fields = struct.pack("<4H2LH", 0, 0, entries, entries, directory_bytes, 4, 0)
        end = b"PK\x05\x06" + fields
    else:
        record_at = 4 + directory_bytes
        record = b"PK\x06\x06" + struct.pack(
            "<Q2H2L4Q", 44, 45, 45, 0, 0, entries, entries, directory_bytes, 4
        )
        locator = b"PK\x06\x07" + struct.pack("<LQL", 0, record_at, 1)
        placeholders = struct.pack("<4H2LH", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
        end = record + locator + b"PK\x05\x06" + placeholders
    return b"PK\x03\x04" + directory + end


@pytest.mark.parametrize(
    ("entries", "directory_bytes", "zip64"),
    [(9, 9 * 46, False), (3, 2 << 20, False), (1_000_000, 46, True), (3, 2 << 20, True)],
    ids=["9 entries", "a 2 MiB directory", "zip64: a million entries", "zip64: a 2 MiB directory"],
)
def test_zip_directory_over_the_limits_is_refused_from_its_end_record(
    tmp_path: Path, entries: int, directory_bytes: int, zip64: bool
) -> None:
    """A zip whose end record declares more entries than the limit, or a central directory
    larger than that many entries can fill, is refused from that record alone: its directory
    (zeros here, which zipfile would find invalid) is never read. zipfile parsed the whole
    directory, whatever its size, before the count was checked: a 47 MB zip of a million
    one-byte names cost ~270 MiB and 7 s before its refusal."""
    archive = tmp_path / "a.zip"
    archive.write_bytes(zip_declaring(entries, directory_bytes, zip64))
    assert refusal(archive, tmp_path / "out") == "unsafe_archive"
