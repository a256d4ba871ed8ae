"""The base model's identity (engine.identity): the same files give the same digest wherever
they lie, and what decides the model's outputs (config, tokenizer, a tensor's header, its
weights' bytes as far as they are read, the dtype) changes it."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loramux.engine.identity import SAMPLE_BYTES, folder_digest, model_identity

SMALL_WHOLE = 1 << 10
"""A whole-file threshold below the test checkpoint's size, so its weights are sampled."""


def checkpoint(folder: Path, rows: int = 1024) -> Path:
    """A folder with a config and one float32 tensor of `rows` x 1024 (4 MiB for 1024 rows)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 1024}))
    weights = torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024)
    save_file({"embed.weight": weights}, folder / "model.safetensors")
    return folder


def poke(path: Path, offset: int) -> None:
    """Flip one byte of `path` at `offset` (from the end when negative)."""
    with path.open("r+b") as f:
        f.seek(offset, 2 if offset < 0 else 0)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def header_length(path: Path) -> int:
    return int(struct.unpack("<Q", path.read_bytes()[:8])[0])


def test_a_copy_elsewhere_has_the_same_identity(tmp_path: Path) -> None:
    original = checkpoint(tmp_path / "a")
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(original, copy)  # another path, other times
    (copy / ".cache").mkdir()  # hidden entries are no part of the model
    (copy / ".gitattributes").write_text("*.safetensors filter=lfs")
    assert folder_digest(copy) == folder_digest(original)
    assert folder_digest(copy, SMALL_WHOLE) == folder_digest(original, SMALL_WHOLE)
    assert model_identity(copy, "float32") == model_identity(original, "float32")


@pytest.mark.parametrize("whole", [SMALL_WHOLE, 64 << 20], ids=["sampled", "whole"])
def test_config_tokenizer_header_and_sampled_bytes_change_it(tmp_path: Path, whole: int) -> None:
    folder = checkpoint(tmp_path / "m")
    weights = folder / "model.safetensors"
    seen = {folder_digest(folder, whole)}
    (folder / "config.json").write_text(json.dumps({"hidden_size": 1024, "rope_theta": 1e6}))
    seen.add(folder_digest(folder, whole))
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    seen.add(folder_digest(folder, whole))
    poke(weights, 8 + header_length(weights) + 4)  # the first tensor's first bytes
    seen.add(folder_digest(folder, whole))
    poke(weights, -1)  # the last byte
    seen.add(folder_digest(folder, whole))
    weights.unlink()  # same size, another shape: only the header says so
    save_file({"embed.weight": torch.zeros(2048, 512)}, weights)
    seen.add(folder_digest(folder, whole))
    assert len(seen) == 6


def test_a_large_files_middle_is_sampled_not_read(tmp_path: Path) -> None:
    """The documented compromise: past the whole-file threshold, bytes outside the first and
    last SAMPLE_BYTES are not read (a 16 GB checkpoint is not read at every start)."""
    folder = checkpoint(tmp_path / "m", rows=1024)  # 4 MiB of weights
    weights = folder / "model.safetensors"
    middle = weights.stat().st_size // 2
    assert SAMPLE_BYTES < middle < weights.stat().st_size - SAMPLE_BYTES
    before = folder_digest(folder, SMALL_WHOLE), folder_digest(folder)
    poke(weights, middle)
    after = folder_digest(folder, SMALL_WHOLE), folder_digest(folder)
    assert after[0] == before[0] and after[1] != before[1]


def test_the_dtype_and_random_weights_change_it(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "m", rows=4)
    identities = {
        model_identity(folder, "float32"),
        model_identity(folder, "bfloat16"),
        model_identity(folder, "float32", random_weights=True),
    }
    assert len(identities) == 3
