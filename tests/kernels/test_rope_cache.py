"""Rotary embedding with the KV cache write fused: the torch twin is transformers'
apply_rotary_pos_emb followed by the cache write, bit for bit, and the Triton kernel
(interpreted on CPU, compiled on CUDA) writes the same rotated queries, the same keys and values
at the step's slots, and nothing anywhere else."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from loramux.kernels.paged_attention_ref import write_kv_cache
from loramux.kernels.rope_cache import rope_and_cache, rope_and_cache_torch, rope_and_cache_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK = 16


@dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def make_step(
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
) -> Step:
    """q, k, v as views into one fused [T, (H + 2 Hkv) D] projection (as the model splits it),
    rope tables for 512 positions, distinct random slots in a 12-block cache full of a poison."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 2
    qkv = qkv.to(device=device, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(512).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    slots = torch.randperm(12 * BLOCK, generator=g)[:tokens]
    cache = torch.full((12, BLOCK, kv_heads, head_dim), 7.0, dtype=dtype)
    return Step(
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.reshape(tokens, kv_heads, head_dim),
        positions.to(device),
        emb.cos().to(device=device, dtype=dtype),
        emb.sin().to(device=device, dtype=dtype),
        slots.to(device),
        cache.to(device),
        cache.clone().to(device),
    )


def _run(fn: object, s: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_cache, v_cache = s.k_cache.clone(), s.v_cache.clone()
    q = fn(s.q, s.k, s.v, s.positions, s.cos, s.sin, k_cache, v_cache, s.slots)  # type: ignore[operator]
    return q, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_twin_is_transformers_rotary_embedding_then_the_cache_write(dtype: torch.dtype) -> None:
    s = make_step(9, 4, 2, 32, dtype)
    q, k_cache, v_cache = _run(rope_and_cache_torch, s)
    cos, sin = s.cos[s.positions], s.sin[s.positions]
    want_q, want_k = apply_rotary_pos_emb(s.q, s.k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(q, want_q)
    want_k_cache, want_v_cache = s.k_cache.clone(), s.v_cache.clone()
    write_kv_cache(want_k_cache, want_v_cache, want_k, s.v, s.slots)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)


def _assert_same(got: torch.Tensor, want: torch.Tensor, exact: bool, scale: float) -> None:
    """Equal, or within two roundings (a product, then the sum) of values up to `scale`, at the
    dtype's step."""
    if exact:
        assert torch.equal(got, want)
    else:
        step = 2**-7 if got.dtype == torch.bfloat16 else 2**-23
        torch.testing.assert_close(got, want, rtol=step, atol=2 * step * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"),
    [(1, 4, 4, 32), (7, 8, 2, 64), (33, 6, 2, 96), (5, 3, 1, 16)],
)
def test_the_kernel_equals_the_twin(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    s = make_step(tokens, heads, kv_heads, head_dim, dtype, seed=tokens)
    got = _run(rope_and_cache_triton, s)
    want = _run(rope_and_cache_torch, s)
    # The interpreter rounds fp32 to bf16 toward zero (a GPU to nearest, as torch): bf16 is
    # exact on CUDA (the gpu test below), within one bf16 step here.
    exact = dtype != torch.bfloat16
    scale = float(torch.cat([s.q.flatten(), s.k.flatten()]).abs().max())
    _assert_same(got[0], want[0], exact, scale)
    _assert_same(got[1], want[1], exact, scale)
    assert torch.equal(got[2], want[2]), "values are copied, not computed"
    untouched = torch.ones(12 * BLOCK, dtype=torch.bool)
    untouched[s.slots] = False
    for cache in got[1:]:
        assert (cache.view(12 * BLOCK, -1)[untouched] == 7.0).all()


def test_an_empty_step_writes_nothing() -> None:
    s = make_step(4, 2, 1, 16, torch.float32)
    empty = Step(
        s.q[:0], s.k[:0], s.v[:0], s.positions[:0], s.cos, s.sin, s.slots[:0], s.k_cache, s.v_cache
    )
    q, k_cache, _ = _run(rope_and_cache_triton, empty)
    assert q.shape == (0, 2, 16) and (k_cache == 7.0).all()


def test_cpu_tensors_take_the_twin() -> None:
    s = make_step(6, 4, 2, 32, torch.float32)
    got, want = _run(rope_and_cache, s), _run(rope_and_cache_torch, s)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
def test_compiled_kernel_on_cuda_equals_the_twin_at_serving_sizes(
    dtype: torch.dtype, tokens: int
) -> None:
    s = make_step(tokens, 32, 8, 128, dtype, device="cuda", seed=tokens)
    got = _run(rope_and_cache, s)
    want = _run(rope_and_cache_torch, s)
    exact = dtype != torch.float32  # fp32: the GPU may fuse a product into the add
    scale = float(torch.cat([s.q.flatten(), s.k.flatten()]).abs().max())
    _assert_same(got[0], want[0], exact, scale)
    _assert_same(got[1], want[1], exact, scale)
    assert torch.equal(got[2], want[2])
