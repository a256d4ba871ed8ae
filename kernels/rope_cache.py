"""Rotary embedding of a step's queries and keys, with the keys and values written into the paged
KV cache, in one Triton kernel on CUDA. The torch form launches about fourteen small kernels a
layer: the cos/sin gathers, multiply, negate, concatenate, multiply and add for q and again for
k, and the two cache writes (docs/gpu-runs.md).

Numerics are transformers' `q * cos + rotate_half(q) * sin` in the model's dtype, each product
and the sum rounded to it as torch rounds them, with rotate_half(x) = cat(-x[half:], x[:half]):
the kernel equals its torch twin (`rope_and_cache_torch`, which the CPU runs) exactly for fp16 and
bf16 on a GPU; for fp32 the GPU may fuse a product into the add (one rounding fewer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux.kernels.paged_attention_ref import write_kv_cache


@triton.jit
def _rotate(x1, x2, c1, s1, c2, s2, like_ptr):
    """Both halves of x * cos + rotate_half(x) * sin, rounded to `like_ptr`'s element type where
    torch rounds."""
    dtype = like_ptr.dtype.element_ty
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    low = (x1 * c1).to(dtype).to(tl.float32) + ((-x2) * s1).to(dtype).to(tl.float32)
    high = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    return low.to(dtype), high.to(dtype)


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_table, stride_slot, stride_head,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program: one token: its q heads rotated into q_out, its k heads rotated and its v heads
    copied into the cache slot `slots[t]`."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    row = pos * stride_table + d
    c1 = tl.load(cos_ptr + row, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF, mask=d_ok, other=0.0).to(tl.float32)

    hq = tl.arange(0, BLOCK_Q)
    q_ok = (hq < NUM_Q)[:, None] & d_ok[None, :]
    q_in = q_ptr + t * stride_qt + hq[:, None] * stride_qh + d[None, :]
    low, high = _rotate(
        tl.load(q_in, mask=q_ok, other=0.0),
        tl.load(q_in + HALF, mask=q_ok, other=0.0),
        c1[None, :], s1[None, :], c2[None, :], s2[None, :], q_out_ptr,
    )  # fmt: skip
    q_out = q_out_ptr + t * stride_ot + hq[:, None] * stride_oh + d[None, :]
    tl.store(q_out, low, mask=q_ok)
    tl.store(q_out + HALF, high, mask=q_ok)

    hk = tl.arange(0, BLOCK_KV)
    kv_ok = (hk < NUM_KV)[:, None] & d_ok[None, :]
    k_in = k_ptr + t * stride_kt + hk[:, None] * stride_kh + d[None, :]
    low, high = _rotate(
        tl.load(k_in, mask=kv_ok, other=0.0),
        tl.load(k_in + HALF, mask=kv_ok, other=0.0),
        c1[None, :], s1[None, :], c2[None, :], s2[None, :], q_out_ptr,
    )  # fmt: skip
    cache = slot * stride_slot + hk[:, None] * stride_head + d[None, :]
    k_dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cache, low.to(k_dtype), mask=kv_ok)
    tl.store(k_cache_ptr + cache + HALF, high.to(k_dtype), mask=kv_ok)
    v_in = v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
    v_dtype = v_cache_ptr.dtype.element_ty
    tl.store(v_cache_ptr + cache, tl.load(v_in, mask=kv_ok).to(v_dtype), mask=kv_ok)
    tl.store(v_cache_ptr + cache + HALF, tl.load(v_in + HALF, mask=kv_ok).to(v_dtype), mask=kv_ok)


def rope_and_cache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotated q ([T, Hq, D], new), with k rotated and v written at their cache slots.

    q [T, Hq, D], k and v [T, Hkv, D] (any row and head strides, dims contiguous); positions and
    slot_mapping [T] ints; cos, sin [max_len, D] in q's dtype; caches [N, block, Hkv, D]
    contiguous (a slot s is block s // block, offset s % block)."""
    num_tokens, num_q, head_dim = q.shape
    num_kv = k.shape[1]
    assert head_dim % 2 == 0 and k.shape == v.shape == (num_tokens, num_kv, head_dim)
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.stride() == sin.stride()
    assert cos.stride(1) == 1 and cos.dtype == sin.dtype == q.dtype == k.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv, head_dim)
    out = torch.empty((num_tokens, num_q, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    half = head_dim // 2
    _rope_cache_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, slot_mapping, out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), cos.stride(0), num_kv * head_dim, head_dim,
        NUM_Q=num_q, NUM_KV=num_kv, HALF=half,
        BLOCK_Q=triton.next_power_of_2(num_q), BLOCK_KV=triton.next_power_of_2(num_kv),
        BLOCK_D=triton.next_power_of_2(half), num_warps=4,
    )  # fmt: skip
    return out


def rope_and_cache_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The twin, in transformers' own operations (the CPU path, and the reference)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    write_kv_cache(k_cache, v_cache, k, v, slot_mapping)
    return q


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The kernel on CUDA tensors, the twin otherwise; same semantics."""
    args = (q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    if q.is_cuda:
        return rope_and_cache_triton(*args)
    return rope_and_cache_torch(*args)
