"""LoRA expand kernels: ``y[i, cols(l)] += t[l, i, :r] @ B(slot(i), l).T`` for every token i
that uses an adapter and every slice l of the projection group, where cols(l) is the slice's
range of output columns and r = ranks[slot, l]. B(slot, l) is the [width(l), r] row-major matrix
at element ``b_offsets[slot, l]`` of the flat adapter pool (adapters.layout). A DoRA slice
(``scale_offsets[slot, l] >= 0``) is then multiplied by its per-column scale in the epilogue:
``y[i, cols(l)] = (y[i, cols(l)] + delta) * pool[scale_offsets[slot, l]:][:width(l)]``.

SGMV (segments) tiles each segment's tokens and runs tl.dot; BGMV (per token, any order, a
CUDA graph's fixed grid) takes blocks of listed tokens and reads each distinct slot's B once per
block. Both grid over the group's L slices in one launch, loop over
the rank only up to the slot's rank, and skip slices of rank 0. Every element of y is owned by
one program, so y is updated with a plain read-add-write (deterministic, no atomics).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loramux.kernels.lora_meta import (
    INTERPRET,
    locate_segment_tile,
    pow2_clamp,
    segment_block_m,
    segment_tile_bound,
    segments_pad,
)


@dataclass(frozen=True)
class ExpandTiles:
    """Block sizes of one expand launch: tokens x output columns x rank."""

    block_m: int
    block_n: int
    block_k: int


def sgmv_expand_tiles(num_tokens: int, num_segs: int, max_width: int, rank: int) -> ExpandTiles:
    """Tiles for ``sgmv_expand``: block_m follows the mean segment length, 128 output columns
    and up to 64 ranks per step on a GPU; most of a slice's width interpreted."""
    block_n = pow2_clamp(max_width, 16, 1024) if INTERPRET else 128
    block_k = pow2_clamp(rank, 16, 128 if INTERPRET else 64)
    return ExpandTiles(segment_block_m(num_tokens, num_segs), block_n, block_k)


def bgmv_expand_tiles(num_tokens: int, max_width: int, rank: int) -> ExpandTiles:
    """Tiles for ``bgmv_expand``: 16 listed tokens per program (tl.dot's minimum), each distinct
    slot among them read once; on a GPU 64 output columns and up to 64 ranks per step,
    interpreted the whole rank and about a million elements per step."""
    block_k = pow2_clamp(rank, 16, 128 if INTERPRET else 64)
    if not INTERPRET:
        return ExpandTiles(16, 64, block_k)
    return ExpandTiles(16, pow2_clamp(max_width, 16, (1 << 20) // (16 * block_k)), block_k)


@functools.lru_cache(maxsize=64)
def _offsets_on(slice_offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Slice offsets as an int32 device tensor, made once per (layout, device)."""
    return torch.tensor(slice_offsets, dtype=torch.int32, device=device)


def _slice_layout(
    t: torch.Tensor,
    pool: torch.Tensor,
    b_offsets: torch.Tensor,
    slice_offsets: Sequence[int],
    ranks: torch.Tensor,
    y: torch.Tensor,
    scale_offsets: torch.Tensor | None,
) -> tuple[tuple[int, ...], int]:
    """Checks shapes and dtypes against ``slice_offsets``; returns (offsets, widest slice)."""
    if scale_offsets is not None:
        assert scale_offsets.shape == ranks.shape and scale_offsets.dtype == torch.int64
        assert scale_offsets.stride() == ranks.stride()
    offsets = tuple(slice_offsets)
    num_slices = len(offsets) - 1
    assert offsets[0] == 0 and offsets[-1] == y.shape[1]
    assert all(a < b for a, b in itertools.pairwise(offsets))
    assert ranks.dim() == 2 and ranks.shape[1] == num_slices and ranks.dtype == torch.int32
    assert b_offsets.shape == ranks.shape and b_offsets.dtype == torch.int64
    assert b_offsets.stride() == ranks.stride()
    assert t.shape == (num_slices, y.shape[0], t.shape[2]) and t.dtype == torch.float32
    assert pool.dim() == 1 and y.dtype == pool.dtype
    return offsets, max(b - a for a, b in itertools.pairwise(offsets))


def sgmv_expand(
    t: torch.Tensor,
    pool: torch.Tensor,
    b_offsets: torch.Tensor,
    slice_offsets: Sequence[int],
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    y: torch.Tensor,
    scale_offsets: torch.Tensor | None = None,
) -> None:
    """Segmented LoRA expand, all slices of a projection group in one launch, added into y.

    Semantics (t float32 [L, T, R]; pool [P] y's dtype; b_offsets int64 [S, L]; slice_offsets
    L+1 host ints, 0 = off[0] < ... < off[L] = N; ranks int32 [S, L], each at most R; seg_*
    int32 [G]; y [T, N]; B(slot, l) = pool[b_offsets[slot, l]:][:(c1 - c0) * r].view(c1 - c0, r)):
        for g in range(G):
            s0, n, slot = seg_starts[g], seg_lens[g], seg_slots[g]
            for l in range(L):
                r, c0, c1 = ranks[slot, l], off[l], off[l+1]   # r == 0: no work
                y[s0:s0+n, c0:c1] += t[l, s0:s0+n, :r] @ B(slot, l).T
                if scale_offsets is not None and scale_offsets[slot, l] >= 0:   # DoRA
                    y[s0:s0+n, c0:c1] *= pool[scale_offsets[slot, l]:][:c1 - c0]
    accumulated in fp32 and rounded once into y's dtype (on a GPU the product's inputs are
    t rounded to y's dtype and B, as tf32 when fp32). Rows outside every segment are untouched.
    """
    offsets, max_width = _slice_layout(t, pool, b_offsets, slice_offsets, ranks, y, scale_offsets)
    num_segs = seg_starts.shape[0]
    if num_segs == 0:
        return
    tiles = sgmv_expand_tiles(y.shape[0], num_segs, max_width, t.shape[2])
    grid = (
        segment_tile_bound(y.shape[0], num_segs, tiles.block_m),
        len(offsets) - 1,
        triton.cdiv(max_width, tiles.block_n),
    )
    _sgmv_expand_kernel[grid](
        t, pool, b_offsets, _offsets_on(offsets, y.device), ranks, seg_starts, seg_lens, seg_slots, y,
        b_offsets if scale_offsets is None else scale_offsets,
        num_segs,
        t.stride(0), t.stride(1), t.stride(2),
        ranks.stride(0), ranks.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SEGS_PAD=segments_pad(num_segs), DOT_F32=INTERPRET, HAS_SCALE=scale_offsets is not None,
    )  # fmt: skip


@triton.jit
def _sgmv_expand_kernel(
    t_ptr, pool_ptr, b_offsets_ptr, offsets_ptr, ranks_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, y_ptr,
    scale_offsets_ptr,
    num_segs,
    stride_tl, stride_tm, stride_tk,
    stride_rs, stride_rl,
    stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SEGS_PAD: tl.constexpr, DOT_F32: tl.constexpr, HAS_SCALE: tl.constexpr,
):  # fmt: skip
    """Program (segment tile, slice l, column tile): a [BLOCK_M, BLOCK_N] tile of y's slice l,
    summed over the slot's rank in BLOCK_K steps."""
    slice_id = tl.program_id(1)
    pid_n = tl.program_id(2)
    g, tile_m, seg_len = locate_segment_tile(
        seg_lens_ptr, num_segs, tl.program_id(0), BLOCK_M, SEGS_PAD
    )
    if g >= num_segs:
        return
    col_begin = tl.load(offsets_ptr + slice_id)
    width = tl.load(offsets_ptr + slice_id + 1) - col_begin
    slot = tl.load(seg_slots_ptr + g).to(tl.int64)
    rank = tl.load(ranks_ptr + slot * stride_rs + slice_id * stride_rl)
    if (pid_n * BLOCK_N >= width) | (rank == 0):
        return
    b_start = tl.load(b_offsets_ptr + slot * stride_rs + slice_id * stride_rl)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.load(seg_starts_ptr + g).to(tl.int64) + offs_m
    cols = col_begin + offs_n
    m_mask = offs_m < seg_len
    n_mask = offs_n < width
    t_rows = t_ptr + slice_id * stride_tl + rows[:, None] * stride_tm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _add_delta(
        acc, t_rows, stride_tk, pool_ptr + b_start, offs_n, m_mask, n_mask, rank, BLOCK_K, DOT_F32
    )
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    out = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32) + acc
    if HAS_SCALE:  # DoRA: the slot's per-column scale, 1 for a plain LoRA slice (offset -1)
        scale_start = tl.load(scale_offsets_ptr + slot * stride_rs + slice_id * stride_rl)
        scale_mask = n_mask & (scale_start + 0 * offs_n >= 0)  # (broadcast: a vector mask)
        scale = tl.load(pool_ptr + scale_start + offs_n, mask=scale_mask, other=1.0)
        out = out * scale.to(tl.float32)[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _add_delta(
    acc, t_rows, stride_tk, b_ptr, offs_n, row_mask, n_mask, rank,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """``acc + t[rows, :rank] @ B.T`` for one slot's B (``b_ptr``: [width, rank] row-major) over
    the columns ``offs_n``; rows outside ``row_mask`` add nothing (0 x B: the pool holds finite
    weights only). t is rounded to B's dtype for tl.dot (tf32 when fp32), interpreted in fp32
    (``DOT_F32``)."""
    offs_k = tl.arange(0, BLOCK_K)
    t_ptrs = t_rows + offs_k[None, :] * stride_tk
    b_ptrs = b_ptr + offs_n[None, :] * rank + offs_k[:, None]
    for _ in range(0, rank, BLOCK_K):
        k_mask = offs_k < rank
        tt = tl.load(t_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_F32:
            bt = bt.to(tl.float32)
        else:
            tt = tt.to(bt.dtype)
        acc = tl.dot(tt, bt, acc)
        offs_k += BLOCK_K
        t_ptrs += BLOCK_K * stride_tk
        b_ptrs += BLOCK_K
    return acc


def bgmv_expand(
    t: torch.Tensor,
    pool: torch.Tensor,
    b_offsets: torch.Tensor,
    slice_offsets: Sequence[int],
    ranks: torch.Tensor,
    token_indices: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    scale_offsets: torch.Tensor | None = None,
) -> None:
    """Per-token LoRA expand, all slices of a projection group in one launch, added into y.

    Semantics (t, pool, b_offsets, slice_offsets, ranks, B(slot, l) and y as for
    ``sgmv_expand``; token_indices, token_slots int32 [T'], indices distinct):
        for p in range(T'):
            i, slot = token_indices[p], token_slots[p]
            if slot == NO_SLOT: continue                    # -1: no adapter, row untouched
            for l in range(L):
                r, c0, c1 = ranks[slot, l], off[l], off[l+1]   # r == 0: no work
                y[i, c0:c1] += B(slot, l) @ t[l, i, :r]
                if scale_offsets is not None and scale_offsets[slot, l] >= 0:   # DoRA
                    y[i, c0:c1] *= pool[scale_offsets[slot, l]:][:c1 - c0]
    accumulated in fp32 and rounded once into y's dtype (on a GPU, as ``sgmv_expand``: the
    product's inputs are t rounded to y's dtype and B, as tf32 when fp32). Rows not listed are
    untouched.
    """
    offsets, max_width = _slice_layout(t, pool, b_offsets, slice_offsets, ranks, y, scale_offsets)
    num_active = token_indices.shape[0]
    if num_active == 0:
        return
    tiles = bgmv_expand_tiles(num_active, max_width, t.shape[2])
    grid = (
        triton.cdiv(num_active, tiles.block_m),
        len(offsets) - 1,
        triton.cdiv(max_width, tiles.block_n),
    )
    _bgmv_expand_kernel[grid](
        t, pool, b_offsets, _offsets_on(offsets, y.device), ranks, token_indices, token_slots, y,
        b_offsets if scale_offsets is None else scale_offsets,
        num_active,
        t.stride(0), t.stride(1), t.stride(2),
        ranks.stride(0), ranks.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        HAS_SCALE=scale_offsets is not None, DOT_F32=INTERPRET,
    )  # fmt: skip


@triton.jit
def _bgmv_expand_kernel(
    t_ptr, pool_ptr, b_offsets_ptr, offsets_ptr, ranks_ptr, token_indices_ptr, token_slots_ptr, y_ptr,
    scale_offsets_ptr,
    num_active,
    stride_tl, stride_tm, stride_tk,
    stride_rs, stride_rl,
    stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """Program (block of BLOCK_M listed tokens, slice l, column tile): a [BLOCK_M, BLOCK_N] tile
    of y's slice l. The block's distinct slots are taken one at a time: each slot's B tile is
    read once and multiplied with the rows of the block's tokens on that slot (the others
    masked to zero), so tokens that share an adapter share its reads; the engine lists a step's
    tokens in slot order, so a block holds few slots. As in the segmented kernel: t rounded to
    B's dtype for tl.dot (tf32 when fp32), fp32 sums, over the slot's own rank."""
    slice_id = tl.program_id(1)
    pid_n = tl.program_id(2)
    col_begin = tl.load(offsets_ptr + slice_id)
    width = tl.load(offsets_ptr + slice_id + 1) - col_begin
    if pid_n * BLOCK_N >= width:
        return
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_active
    slots = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)
    active = slots >= 0  # NO_SLOT (-1): a token without an adapter
    rank = tl.load(
        ranks_ptr + slots.to(tl.int64) * stride_rs + slice_id * stride_rl, mask=active, other=0
    )
    todo = rank > 0
    if tl.sum(todo.to(tl.int32), 0) == 0:
        return
    rows = tl.load(token_indices_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = col_begin + offs_n
    n_mask = offs_n < width
    t_rows = t_ptr + slice_id * stride_tl + rows[:, None] * stride_tm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale = tl.full((BLOCK_M, BLOCK_N), 1.0, dtype=tl.float32)
    left = tl.sum(todo.to(tl.int32), 0)
    while left > 0:
        slot = tl.min(tl.where(todo, slots, 2147483647), 0)  # the block's next slot
        mine = todo & (slots == slot)
        slot_rank = tl.max(tl.where(mine, rank, 0), 0)
        entry = slot.to(tl.int64) * stride_rs + slice_id * stride_rl
        b_start = tl.load(b_offsets_ptr + entry)
        acc = _add_delta(
            acc, t_rows, stride_tk, pool_ptr + b_start, offs_n, mine, n_mask, slot_rank,
            BLOCK_K, DOT_F32,
        )  # fmt: skip
        if HAS_SCALE:  # DoRA: the slot's per-column scale, 1 for a plain LoRA slice (offset -1)
            scale_start = tl.load(scale_offsets_ptr + entry)
            scale_mask = n_mask & (scale_start + 0 * offs_n >= 0)  # (broadcast: a vector mask)
            slot_scale = tl.load(pool_ptr + scale_start + offs_n, mask=scale_mask, other=1.0)
            scale = tl.where(mine[:, None], slot_scale.to(tl.float32)[None, :], scale)
        todo = todo & (slots != slot)
        left = tl.sum(todo.to(tl.int32), 0)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    y_mask = (rank > 0)[:, None] & n_mask[None, :]
    out = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32) + acc
    if HAS_SCALE:
        out = out * scale
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)
