"""Paged attention: the torch twin equals plain causal attention over contiguous KV, and the
Triton kernel (interpreted on CPU, compiled on CUDA) equals the twin, for steps that mix decodes,
fresh prefills and chunks continuing a cached prefix, over permuted, non-contiguous blocks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loramux.kernels.paged_attention import (
    AttentionMetadata,
    paged_attention,
    paged_attention_torch,
    paged_attention_triton,
    write_kv_cache,
)

KV_HEADS = 2

# (cached prefix length, query tokens this step) per sequence.
MIXED_STEP = [
    (0, 1),  # decode of a one-token sequence
    (36, 1),  # decode
    (0, 45),  # fresh prefill
    (100, 77),  # chunk continuing a cached prefix
    (298, 1),  # long decode
    (64, 32),  # prefix ending exactly on a block boundary
    (0, 150),  # fresh prefill spanning two query tiles under the interpreter
    (250, 50),  # long continuation
]
DECODE_STEP = [(0, 1), (15, 1), (16, 1), (130, 1), (299, 1)]

# Absolute and relative tolerance: about one rounding of an O(1) output to the dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class Step:
    """One step's inputs, plus each sequence's full K/V contiguous ([L, Hkv, D], cache dtype)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scale: float


def make_step(
    spec: list[tuple[int, int]],
    *,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    group: int,
    device: str = "cpu",
    seed: int = 0,
) -> Step:
    """Random K/V written through `write_kv_cache` into a shuffled pool with spare blocks; unused
    block-table entries point at random (valid) blocks."""
    gen = torch.Generator().manual_seed(seed)
    lens = [prefix + n for prefix, n in spec]
    needed = [-(-length // block_size) for length in lens]
    pool = torch.randperm(sum(needed) + 7, generator=gen).tolist()
    width = max(needed) + 2
    tables, keys, values = [], [], []
    k_cache = torch.zeros(len(pool), block_size, KV_HEADS, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for length, count in zip(lens, needed, strict=True):
        blocks, pool = pool[:count], pool[count:]
        spare = torch.randint(0, k_cache.shape[0], (width - count,), generator=gen).tolist()
        tables.append(blocks + spare)
        k = torch.randn(length, KV_HEADS, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, KV_HEADS, head_dim, generator=gen).to(dtype)
        pos = torch.arange(length)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        write_kv_cache(k_cache, v_cache, k, v, slots)
        keys.append(k)
        values.append(v)
    num_tokens = sum(n for _, n in spec)
    q = (2 * torch.randn(num_tokens, KV_HEADS * group, head_dim, generator=gen)).to(dtype)
    meta = AttentionMetadata.build([n for _, n in spec], lens, tables, device=device)
    return Step(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        meta,
        keys,
        values,
        head_dim**-0.5,
    )


def reference_attention(step: Step) -> torch.Tensor:
    """Explicit causal softmax in fp64 over each sequence's contiguous K/V."""
    outs = []
    start = 0
    for n, k, v in zip(step.meta.q_lens, step.keys, step.values, strict=True):
        group = step.q.shape[1] // k.shape[1]
        q = step.q[start : start + n].cpu().double().transpose(0, 1)  # [H, n, D]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        length = k.shape[1]
        scores = step.scale * q @ k.transpose(1, 2)
        q_pos = torch.arange(length - n, length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
        start += n
    return torch.cat(outs).to(step.q.dtype)


def test_write_kv_cache_puts_each_token_at_its_slot() -> None:
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_cache(k_cache, v_cache, k, v, torch.tensor([3 * 16 + 5, 0, 16 + 15]))
    for t, (block, row) in enumerate([(3, 5), (0, 0), (1, 15)]):
        assert torch.equal(k_cache[block, row], k[t]) and torch.equal(v_cache[block, row], v[t])
    assert k_cache.abs().sum(dim=(2, 3)).count_nonzero() == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("spec", [MIXED_STEP, DECODE_STEP], ids=["mixed", "decodes"])
def test_torch_twin_matches_contiguous_reference(
    dtype: torch.dtype, block_size: int, head_dim: int, group: int, spec: list[tuple[int, int]]
) -> None:
    step = make_step(spec, dtype=dtype, block_size=block_size, head_dim=head_dim, group=group)
    out = paged_attention_torch(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert out.dtype == dtype and out.shape == step.q.shape
    torch.testing.assert_close(
        out, reference_attention(step), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "head_dim", "group"), [(16, 32, 4), (32, 64, 1), (16, 64, 4), (32, 32, 1)]
)
@pytest.mark.parametrize("spec", [MIXED_STEP, DECODE_STEP], ids=["mixed", "decodes"])
def test_triton_kernel_matches_torch_twin(
    dtype: torch.dtype, block_size: int, head_dim: int, group: int, spec: list[tuple[int, int]]
) -> None:
    step = make_step(spec, dtype=dtype, block_size=block_size, head_dim=head_dim, group=group)
    out = paged_attention_triton(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    expected = paged_attention_torch(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_dispatch_runs_the_torch_twin_on_cpu_tensors() -> None:
    step = make_step(MIXED_STEP, dtype=torch.float32, block_size=16, head_dim=32, group=4)
    out = paged_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    expected = paged_attention_torch(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 4), (128, 1), (96, 2)])
def test_compiled_kernel_on_cuda_matches_reference(
    dtype: torch.dtype, head_dim: int, group: int
) -> None:
    step = make_step(
        MIXED_STEP + DECODE_STEP,
        dtype=dtype,
        block_size=16,
        head_dim=head_dim,
        group=group,
        device="cuda",
    )
    out = paged_attention(step.q, step.k_cache, step.v_cache, step.meta, step.scale)
    # fp32 dots run as tf32; fp16/bf16 probabilities are rounded before the PV product.
    tolerance = {torch.float32: 1e-2, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.cpu(), reference_attention(step), atol=tolerance, rtol=tolerance)
