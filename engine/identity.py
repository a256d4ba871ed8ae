"""What decides an engine's outputs besides the request: its code (`engine_build`) and the
base model it serves (`model_identity`). The engine computes both once at start and names them
in its `info` reply, so a gateway keys its response cache and writes `system_fingerprint` by
what the engine really runs, even when the gateway's host has other files (remote engines,
Ray Serve replicas).

The base model's identity is a digest of its folder's top-level files (the files the engine
and the tokenizer read; subfolders, such as a checkpoint's `original/` copy in another format,
are not read) and of the dtype the weights are served in:

- a file of at most WHOLE_FILE_BYTES (config.json, generation_config.json, the tokenizer and
  its chat template, the index of a sharded checkpoint, a small model's weights) by all its
  bytes;
- a larger one by its size and by samples of its bytes, read in offset order from one open file:
  - a `.safetensors` file by its header (every tensor's name, dtype, shape and offsets, and the
    header's metadata), its first and last SAMPLE_BYTES, and TENSOR_SAMPLE_BYTES at the start,
    the middle and the end of every tensor's bytes, at the offsets its header lists (a 16 GB
    checkpoint of ~300 tensors: about 6 MiB read);
  - any other (`.bin`, `.pt`, `.gguf`: no header read) by its first and last SAMPLE_BYTES and
    SPREAD_WINDOWS windows of SPREAD_BYTES evenly spaced across it (6 MiB read), as is a
    `.safetensors` file whose header is not one.

Names and sizes go in, never times: a copy of the same folder elsewhere (another host, another
mount, a restored backup) has the same identity. Reading every byte of a 16 GB checkpoint at
each start would take minutes, so a large file is sampled, not read. A fine-tune changes every
value of each tensor it trains (an MLP-only or attention-only one, a merged LoRA, with frozen
embeddings and the base's config alike), so each trained tensor's samples, and the identity.
What is not seen: a change confined to bytes between the samples of one tensor (a few rows of a
1 GB embedding, a hand edit), and in a file that is not safetensors one between two windows
(every 64 MiB of a 16 GB file: a fine-tune of tensors smaller than that can fall between
them). An operator who serves such weights serves them under another name, or purges the
response cache.
"""

from __future__ import annotations

import hashlib
import json
import struct
from functools import cache
from pathlib import Path
from typing import BinaryIO

WHOLE_FILE_BYTES = 64 << 20
"""Files up to this size are hashed whole (a tokenizer.json is a few MiB)."""
SAMPLE_BYTES = 1 << 20
"""What a larger file contributes from its start and from its end."""
TENSOR_SAMPLE_BYTES = 4 << 10
"""What a large safetensors file contributes from each tensor's start, middle and end."""
SPREAD_WINDOWS = 256
SPREAD_BYTES = 16 << 10
"""A large file that is not safetensors contributes SPREAD_WINDOWS windows of SPREAD_BYTES,
evenly spaced from its start to its end."""
MAX_HEADER_BYTES = 100 << 20
"""The largest safetensors header read (the format's own limit); a larger length is not a
safetensors header and is hashed as the length alone."""
_BUILD_SOURCES = ("engine", "kernels")
"""The packages whose code decides what the engine computes."""


@cache
def engine_build() -> str:
    """A digest of the engine's and the kernels' source: changes with any change to them."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for package in _BUILD_SOURCES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def model_identity(folder: Path, dtype: str, random_weights: bool = False) -> str:
    """The served base model's identity: sha256 of its folder's digest (`folder_digest`), the
    dtype its weights are served in, and whether they are seeded random weights instead."""
    parts = (folder_digest(folder), dtype, "random" if random_weights else "read")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def folder_digest(folder: Path, whole_file_bytes: int = WHOLE_FILE_BYTES) -> str:
    """sha256 over the folder's top-level files, in name order (see the module docstring);
    hidden files and subfolders are left out."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= whole_file_bytes:
                digest.update(f.read())
            else:
                _sample(f, path.suffix == ".safetensors", size, digest)
    return digest.hexdigest()


def _sample(f: BinaryIO, safetensors: bool, size: int, digest: hashlib._Hash) -> None:
    """A large file's safetensors header (when it is one), then the bytes of its windows
    (`_windows`), in offset order, into `digest`."""
    tensors = None
    if safetensors:
        (length,) = struct.unpack("<Q", f.read(8))
        digest.update(struct.pack("<Q", length))
        if length <= min(MAX_HEADER_BYTES, size - 8):
            header = f.read(length)
            digest.update(header)
            tensors = _tensor_ranges(header, 8 + length, size)
    for start, end in _windows(size, tensors):
        f.seek(start)
        digest.update(f.read(end - start))


def _windows(size: int, tensors: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """The byte ranges read from a large file, sorted, overlapping or touching ones merged: its
    first and last SAMPLE_BYTES, and each tensor's start, middle and end (TENSOR_SAMPLE_BYTES
    each) when `tensors` lists their ranges, else SPREAD_WINDOWS evenly spaced windows."""
    windows = [(0, min(size, SAMPLE_BYTES)), (max(0, size - SAMPLE_BYTES), size)]
    if tensors is None:
        last = max(0, size - SPREAD_BYTES)
        for i in range(SPREAD_WINDOWS):
            start = i * last // (SPREAD_WINDOWS - 1)
            windows.append((start, min(size, start + SPREAD_BYTES)))
    for begin, end in tensors or ():
        span = min(end - begin, TENSOR_SAMPLE_BYTES)
        for start in (begin, begin + (end - begin - span) // 2, end - span):
            windows.append((start, start + span))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(windows):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _tensor_ranges(header: bytes, data_start: int, size: int) -> list[tuple[int, int]] | None:
    """Each tensor's byte range in the file, as a safetensors header lists it (data starts
    right after the header); None when the header is not one, or a range lies outside the
    file."""
    try:
        entries = json.loads(header)
    except ValueError:
        return None
    if not isinstance(entries, dict):
        return None
    ranges = []
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            return None
        begin, end = offsets
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            return None
        if data_start + end > size:
            return None
        ranges.append((data_start + begin, data_start + end))
    return ranges
