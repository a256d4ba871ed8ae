"""Paged attention over a block-table KV cache: one Triton kernel for a whole mixed step.

A step's batch is a flat list of query tokens from B sequences — decodes (one token), fresh
prefills, and chunks continuing a cached or earlier-computed prefix — and one launch serves them
all. A program owns one query tile of one sequence for one KV head: its rows are
(query token, query head of that KV head's group) pairs, so a decode under GQA still fills the
rows of a tile with the group's heads and reads each KV block once for all of them. It walks the
sequence's KV positions in tiles of `BLOCK_N` (looking each position's block up in the block
table) with a flash-attention online softmax, stopping at the tile's last causal position.

The plain-torch side (metadata, cache write, twin) lives in `kernels.paged_attention_ref`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loramux.kernels.paged_attention_ref import (
    AttentionMetadata,
    paged_attention_torch,
    write_kv_cache,
)

__all__ = [
    "AttentionMetadata",
    "paged_attention",
    "paged_attention_torch",
    "paged_attention_triton",
    "write_kv_cache",
]

# The interpreter multiplies bf16 bit patterns in tl.dot; it must see fp32 dot inputs instead.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    seq = tl.program_id(0)
    tile_start = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # KV positions before this step's chunk

    # Row r of the tile: query token tile_start + r // GROUP_P, head kv_head * GROUP + r % GROUP_P.
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    tok = tile_start + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_offs = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    # Padding rows (tok >= q_len) get a position past the end: they see every valid key, so no
    # row is ever fully masked and the softmax never divides 0 by 0.
    q_pos = prefix + tok
    kv_end = tl.minimum(seq_len, prefix + tile_start + BLOCK_Q)

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for kv_start in range(0, kv_end, BLOCK_N):
        pos = kv_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        k_offs = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(
            k_cache_ptr + k_offs[None, :] + dims[:, None],
            mask=pos_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        v_offs = block * stride_vb + (pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(
            v_cache_ptr + v_offs[:, None] + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if INTERPRET:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k) * scale_log2e
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_offs = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(
        out_ptr + o_offs,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@dataclass(frozen=True)
class _Tiles:
    """Tile shape of one launch; every tl.dot dimension is at least 16."""

    block_q: int  # query tokens per tile
    group_p: int  # query heads per KV head, padded to a power of two
    block_n: int  # KV positions per inner iteration
    block_d: int  # head_dim padded to a power of two


def _choose_tiles(group: int, head_dim: int, max_q_len: int) -> _Tiles:
    """Large tiles under the interpreter (its cost grows with programs and iterations).

    On a GPU a tile holds about 64 rows; it shrinks to the step's longest chunk (16 rows for an
    all-decode step) so decode-heavy steps do not compute on padding.
    """
    target_rows, block_n = (128, 128) if _INTERPRET else (64, 64)
    group_p = triton.next_power_of_2(group)
    block_q = min(max(1, target_rows // group_p), triton.next_power_of_2(max_q_len))
    block_q = max(block_q, -(-16 // group_p))
    return _Tiles(block_q, group_p, block_n, max(16, triton.next_power_of_2(head_dim)))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each step token over its sequence's paged KV, one Triton launch.

    Semantics (q, out: [T, H, D] fp32/fp16/bf16; caches: [N, bs, Hkv, D] same dtype;
    block_tables int32 [B, max_blocks]; cu_seqlens_q int32 [B + 1]; seq_lens int32 [B];
    G = H // Hkv):
        for b in range(B): for j in range(q_lens[b]):
            t = cu_seqlens_q[b] + j;  pos = seq_lens[b] - q_lens[b] + j
            K = [k_cache[block_tables[b, p // bs], p % bs] for p in 0..pos]     # [pos + 1, Hkv, D]
            for h in range(H):
                out[t, h] = softmax(scale * K[:, h // G] @ q[t, h]) @ V[:, h // G]
    Accumulation is fp32 (fp32 dots are tf32 on a GPU); out has q's dtype. The grid comes from
    the host-side `meta.max_q_len`, so no device sync happens.
    """
    num_tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    assert heads % kv_heads == 0 and k_cache.dtype == v_cache.dtype == q.dtype
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert num_tokens == meta.num_tokens
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    tiles = _choose_tiles(heads // kv_heads, head_dim, meta.max_q_len)
    grid = (len(meta.q_lens), triton.cdiv(meta.max_q_len, tiles.block_q), kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.seq_lens,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        GROUP=heads // kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        GROUP_P=tiles.group_p,
        BLOCK_Q=tiles.block_q,
        BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d,
        INTERPRET=_INTERPRET,
        num_warps=4,
        # Two stages keep an fp32, head_dim-128 K/V tile pair within shared memory.
        num_stages=2,
    )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The Triton kernel on CUDA tensors, the torch twin otherwise; same semantics."""
    if q.is_cuda:
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale)
