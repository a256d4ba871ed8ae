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

from loramux.engine.identity import (
    SAMPLE_BYTES,
    SPREAD_BYTES,
    SPREAD_WINDOWS,
    TENSOR_SAMPLE_BYTES,
    folder_digest,
    model_identity,
)

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


def llama_shard(folder: Path, trained: tuple[str, ...] = ()) -> Path:
    """A Llama-style shard in safetensors' name order: embeddings first, the layer's MLP
    (between the first and the last SAMPLE_BYTES), its attention, the final norm last; the
    tensors named in `trained` get a fine-tune's small dense update."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))  # copied as is
    rows = {"embed_tokens": 320, "mlp.down_proj": 512, "mlp.up_proj": 512}
    rows |= {"self_attn.k_proj": 256, "self_attn.q_proj": 256, "self_attn.v_proj": 320}
    weights, updates = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    tensors = {}
    for name, n in rows.items():
        weight = torch.randn(n, 1024, generator=weights)  # float32: n rows of 4 KiB
        if name in trained:
            weight += 1e-3 * torch.randn(n, 1024, generator=updates)
        prefix = "model." if name == "embed_tokens" else "model.layers.0."
        tensors[f"{prefix}{name}.weight"] = weight
    tensors["model.norm.weight"] = torch.ones(1024)
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(
    "trained",
    [
        ("mlp.down_proj", "mlp.up_proj"),
        ("self_attn.q_proj", "self_attn.k_proj"),
        ("mlp.up_proj", "self_attn.k_proj", "self_attn.q_proj"),  # a merged LoRA
        ("mlp.down_proj",),
    ],
    ids=["mlp", "q-k", "merged-lora", "one-tensor"],
)
def test_a_fine_tune_of_tensors_in_a_shards_middle_changes_it(
    tmp_path: Path, trained: tuple[str, ...]
) -> None:
    """Frozen embeddings and norm, the base's config: the shard's header and its first and
    last SAMPLE_BYTES are the base's, yet the fine-tuned weights get another identity (else the
    response cache replays the base model's answers for them)."""
    base = llama_shard(tmp_path / "base")
    tuned = llama_shard(tmp_path / "tuned", trained)
    base_bytes = (base / "model.safetensors").read_bytes()
    tuned_bytes = (tuned / "model.safetensors").read_bytes()
    assert len(base_bytes) > 4 * SAMPLE_BYTES and base_bytes != tuned_bytes
    assert base_bytes[:SAMPLE_BYTES] == tuned_bytes[:SAMPLE_BYTES]
    assert base_bytes[-SAMPLE_BYTES:] == tuned_bytes[-SAMPLE_BYTES:]
    assert folder_digest(base) != folder_digest(tuned)  # whole
    assert folder_digest(base, SMALL_WHOLE) != folder_digest(tuned, SMALL_WHOLE)  # sampled


def test_bytes_between_a_tensors_samples_are_not_read(tmp_path: Path) -> None:
    """The documented compromise: past the whole-file threshold, a safetensors file's bytes are
    read in its first and last SAMPLE_BYTES and at each tensor's start, middle and end
    (TENSOR_SAMPLE_BYTES each), no more (a 16 GB checkpoint is not read at every start)."""
    folder = checkpoint(tmp_path / "m", rows=1024)  # one tensor of 4 MiB
    weights = folder / "model.safetensors"
    data = 8 + header_length(weights)
    middle = data + (4 << 20) // 2
    between = data + SAMPLE_BYTES + (1 << 16)  # after the first MiB, before the middle sample
    assert between + 1 < middle - TENSOR_SAMPLE_BYTES
    before = folder_digest(folder, SMALL_WHOLE), folder_digest(folder)
    poke(weights, between)
    after = folder_digest(folder, SMALL_WHOLE), folder_digest(folder)
    assert after[0] == before[0] and after[1] != before[1]
    poke(weights, middle)  # the tensor's middle is sampled
    assert folder_digest(folder, SMALL_WHOLE) != after[0]


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_another_large_file_is_read_at_spread_windows(tmp_path: Path, name: str) -> None:
    """A large file that is not safetensors (.bin, .pt, .gguf: no header to read offsets from),
    or whose header is not one, is read in its first and last SAMPLE_BYTES and at
    SPREAD_WINDOWS evenly spaced windows of SPREAD_BYTES; a change between them is not seen."""
    folder = tmp_path / "m"
    folder.mkdir()
    size = 8 << 20
    weights = folder / name
    weights.write_bytes(bytes(range(256)) * (size // 256))
    starts = [i * (size - SPREAD_BYTES) // (SPREAD_WINDOWS - 1) for i in range(SPREAD_WINDOWS)]
    window, following = starts[SPREAD_WINDOWS // 2], starts[SPREAD_WINDOWS // 2 + 1]
    assert window > SAMPLE_BYTES and window + SPREAD_BYTES < following - 1
    seen = {folder_digest(folder, SMALL_WHOLE)}
    poke(weights, following - 1)  # between two windows
    assert folder_digest(folder, SMALL_WHOLE) in seen
    poke(weights, window)
    seen.add(folder_digest(folder, SMALL_WHOLE))
    assert len(seen) == 2


def test_the_dtype_and_random_weights_change_it(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path / "m", rows=4)
    identities = {
        model_identity(folder, "float32"),
        model_identity(folder, "bfloat16"),
        model_identity(folder, "float32", random_weights=True),
    }
    assert len(identities) == 3
