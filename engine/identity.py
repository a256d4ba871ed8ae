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
- a larger one by its size, its safetensors header (every tensor's name, dtype, shape and
  offsets, and the header's metadata) when it is a `.safetensors` file, and its first and last
  SAMPLE_BYTES.

Names and sizes go in, never times: a copy of the same folder elsewhere (another host, another
mount, a restored backup) has the same identity. Reading every byte of a 16 GB checkpoint at
each start would take minutes, so the middle of a large file is sampled, not read: two
checkpoints of one architecture whose weights differ only there (not in the first or last MiB
of any shard, nor in any config or tokenizer file) get one identity. A fine-tune or a new
release changes every tensor, and so the samples; an operator who edits weights by hand in
the middle of a shard serves them under another name, or purges the response cache.
"""

from __future__ import annotations

import hashlib
import struct
from functools import cache
from pathlib import Path
from typing import BinaryIO

WHOLE_FILE_BYTES = 64 << 20
"""Files up to this size are hashed whole (a tokenizer.json is a few MiB)."""
SAMPLE_BYTES = 1 << 20
"""What a larger file contributes from its start and from its end."""
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
    """A large file's safetensors header (when it is one), then its first and last
    SAMPLE_BYTES, into `digest`."""
    if safetensors:
        (length,) = struct.unpack("<Q", f.read(8))
        digest.update(struct.pack("<Q", length))
        if length <= min(MAX_HEADER_BYTES, size - 8):
            digest.update(f.read(length))
    f.seek(0)
    digest.update(f.read(SAMPLE_BYTES))
    f.seek(max(0, size - SAMPLE_BYTES))
    digest.update(f.read(SAMPLE_BYTES))
