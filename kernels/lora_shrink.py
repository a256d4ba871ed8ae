"""LoRA shrink kernels: ``t[l, i, :r] = x[i] @ A(slot(i), l).T`` for every token i that uses
an adapter, every slice l of the projection group, at the slot's own rank r = ranks[slot, l].
A(slot, l) is the [r, H] row-major matrix at element ``a_offsets[slot, l]`` of the flat adapter
pool (adapters.layout), so each adapter's weights take only its own rank's memory.

SGMV (segments, prefill and mixed batches) tiles each segment's tokens and runs tl.dot; BGMV
(per token in any order, decode and a CUDA graph's fixed grid) takes blocks of listed tokens and
reads each distinct slot's A once per block. Both grid over the group's L
slices in one launch, tile the rank dimension and skip rank tiles at or beyond the slot's rank,
and split the hidden dimension (with atomic adds into the caller-zeroed ``t``) when too few
programs would otherwise run.
"""

from __future__ import annotations

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
class ShrinkTiles:
    """Block sizes of one shrink launch: tokens x rank x hidden, and hidden splits."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int


def _split_k(programs: int, k_blocks: int) -> int:
    """Hidden-dimension splits that bring the launch near two waves of an H100 (132 SMs), or
    near a handful of programs under the interpreter; a power of two, at most ``k_blocks``."""
    target = 8 if INTERPRET else 264
    want = max(1, target // max(programs, 1))
    split = 1
    while split * 2 <= min(want, k_blocks):
        split *= 2
    return split


def sgmv_shrink_tiles(
    num_tokens: int, num_segs: int, hidden: int, rank: int, slices: int
) -> ShrinkTiles:
    """Tiles for ``sgmv_shrink``: block_m follows the mean segment length, block_n covers the
    maximum rank up to 64 on a GPU, block_k is 64 on a GPU and most of ``hidden`` interpreted."""
    block_m = segment_block_m(num_tokens, num_segs)
    block_n = pow2_clamp(rank, 16, 128 if INTERPRET else 64)
    block_k = pow2_clamp(hidden, 16, 512) if INTERPRET else 64
    programs = (
        segment_tile_bound(num_tokens, num_segs, block_m) * triton.cdiv(rank, block_n) * slices
    )
    return ShrinkTiles(block_m, block_n, block_k, _split_k(programs, triton.cdiv(hidden, block_k)))


def bgmv_shrink_tiles(num_tokens: int, hidden: int, rank: int, slices: int) -> ShrinkTiles:
    """Tiles for ``bgmv_shrink``: 16 listed tokens per program (tl.dot's minimum), each distinct
    slot among them read once; on a GPU 16 ranks x 256 hidden per step, so a rank-8 slot reads
    one 16-row tile; interpreted, the whole rank and up to 512 hidden per step."""
    if not INTERPRET:
        programs = triton.cdiv(num_tokens, 16) * triton.cdiv(rank, 16) * slices
        return ShrinkTiles(16, 16, 256, _split_k(programs, triton.cdiv(hidden, 256)))
    block_n = pow2_clamp(rank, 16, 128)
    block_k = pow2_clamp(hidden, 16, min(512, (1 << 20) // (16 * block_n)))
    programs = triton.cdiv(num_tokens, 16) * triton.cdiv(rank, block_n) * slices
    return ShrinkTiles(16, block_n, block_k, _split_k(programs, triton.cdiv(hidden, block_k)))


def _check(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    t: torch.Tensor,
) -> None:
    assert x.dim() == 2 and pool.dim() == 1 and x.dtype == pool.dtype
    assert a_offsets.dtype == torch.int64 and a_offsets.stride() == ranks.stride()
    assert a_offsets.shape == ranks.shape
    assert ranks.dim() == 2 and ranks.dtype == torch.int32
    assert t.shape == (ranks.shape[1], x.shape[0], t.shape[2]) and t.dtype == torch.float32


def sgmv_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    t: torch.Tensor,
) -> None:
    """Segmented LoRA shrink, all slices of a projection group in one launch.

    Semantics (x [T, H] fp32/fp16/bf16; pool [P] x's dtype; a_offsets int64 [S, L];
    ranks int32 [S, L], each at most R; seg_* int32 [G]; t float32 [L, T, R], zeroed by the
    caller; A(slot, l) = pool[a_offsets[slot, l]:][:r * H].view(r, H)):
        for g in range(G):
            s0, n, slot = seg_starts[g], seg_lens[g], seg_slots[g]
            for l in range(L):
                r = ranks[slot, l]                          # 0: slice not targeted, no work
                t[l, s0:s0+n, :r] = x[s0:s0+n] @ A(slot, l).T              # fp32 accumulate
    Entries of t outside every segment's rows and ranks are left as they are.
    """
    _check(x, pool, a_offsets, ranks, t)
    num_segs = seg_starts.shape[0]
    if num_segs == 0:
        return
    num_slices, max_rank, hidden = ranks.shape[1], t.shape[2], x.shape[1]
    tiles = sgmv_shrink_tiles(x.shape[0], num_segs, hidden, max_rank, num_slices)
    k_iters = triton.cdiv(triton.cdiv(hidden, tiles.block_k), tiles.split_k)
    grid = (
        segment_tile_bound(x.shape[0], num_segs, tiles.block_m),
        num_slices,
        triton.cdiv(max_rank, tiles.block_n) * tiles.split_k,
    )
    _sgmv_shrink_kernel[grid](
        x, pool, a_offsets, ranks, seg_starts, seg_lens, seg_slots, t,
        num_segs, hidden, k_iters,
        x.stride(0), x.stride(1),
        ranks.stride(0), ranks.stride(1),
        t.stride(0), t.stride(1), t.stride(2),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SPLIT_K=tiles.split_k, SEGS_PAD=segments_pad(num_segs), DOT_F32=INTERPRET,
    )  # fmt: skip


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, pool_ptr, a_offsets_ptr, ranks_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, t_ptr,
    num_segs, hidden, k_iters,
    stride_xm, stride_xk,
    stride_rs, stride_rl,
    stride_tl, stride_tm, stride_tr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SEGS_PAD: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Program (segment tile, slice l, rank tile x hidden split): a [BLOCK_M, BLOCK_N] tile of
    t[l] summed over this split's share of the hidden dimension."""
    slice_id = tl.program_id(1)
    pid_n = tl.program_id(2) // SPLIT_K
    pid_k = tl.program_id(2) % SPLIT_K
    g, tile_m, seg_len = locate_segment_tile(
        seg_lens_ptr, num_segs, tl.program_id(0), BLOCK_M, SEGS_PAD
    )
    if g >= num_segs:
        return
    slot = tl.load(seg_slots_ptr + g).to(tl.int64)
    rank = tl.load(ranks_ptr + slot * stride_rs + slice_id * stride_rl)
    if pid_n * BLOCK_N >= rank:
        return
    a_start = tl.load(a_offsets_ptr + slot * stride_rs + slice_id * stride_rl)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.load(seg_starts_ptr + g).to(tl.int64) + offs_m
    m_mask = offs_m < seg_len
    n_mask = offs_n < rank
    offs_k = pid_k * k_iters * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = pool_ptr + a_start + offs_n[None, :] * hidden + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(k_iters):
        k_mask = offs_k < hidden
        xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_F32:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc)
        offs_k += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K
    t_ptrs = t_ptr + slice_id * stride_tl + rows[:, None] * stride_tm + offs_n[None, :] * stride_tr
    if SPLIT_K == 1:
        tl.store(t_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.atomic_add(t_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


def bgmv_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    token_indices: torch.Tensor,
    token_slots: torch.Tensor,
    t: torch.Tensor,
) -> None:
    """Per-token LoRA shrink, all slices of a projection group in one launch.

    Semantics (x [T, H] fp32/fp16/bf16; pool, a_offsets, ranks and A(slot, l) as for
    ``sgmv_shrink``; token_indices, token_slots int32 [T'], indices distinct; t float32
    [L, T, R], zeroed):
        for p in range(T'):
            i, slot = token_indices[p], token_slots[p]
            if slot == NO_SLOT: continue                    # -1: no adapter, x[i] not read
            for l in range(L):
                r = ranks[slot, l]                          # 0: slice not targeted, no work
                t[l, i, :r] = A(slot, l) @ x[i]                           # fp32 accumulate
    Entries of t outside the listed tokens' rows and ranks are left as they are.
    """
    _check(x, pool, a_offsets, ranks, t)
    num_active = token_indices.shape[0]
    if num_active == 0:
        return
    num_slices, max_rank, hidden = ranks.shape[1], t.shape[2], x.shape[1]
    tiles = bgmv_shrink_tiles(num_active, hidden, max_rank, num_slices)
    k_iters = triton.cdiv(triton.cdiv(hidden, tiles.block_k), tiles.split_k)
    grid = (
        triton.cdiv(num_active, tiles.block_m),
        num_slices,
        triton.cdiv(max_rank, tiles.block_n) * tiles.split_k,
    )
    _bgmv_shrink_kernel[grid](
        x, pool, a_offsets, ranks, token_indices, token_slots, t,
        num_active, hidden, k_iters,
        x.stride(0), x.stride(1),
        ranks.stride(0), ranks.stride(1),
        t.stride(0), t.stride(1), t.stride(2),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k,
        DOT_F32=INTERPRET,
    )  # fmt: skip


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, pool_ptr, a_offsets_ptr, ranks_ptr, token_indices_ptr, token_slots_ptr, t_ptr,
    num_active, hidden, k_iters,
    stride_xm, stride_xk,
    stride_rs, stride_rl,
    stride_tl, stride_tm, stride_tr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """Program (block of BLOCK_M listed tokens, slice l, rank tile x hidden split): a
    [BLOCK_M, BLOCK_N] tile of t[l]. For each hidden step the block's x rows are read once,
    then each distinct slot of the block reads its A tile once and multiplies it with the rows
    of its tokens by tl.dot (the others masked to zero), so tokens that share an adapter share
    its reads. As in the segmented kernel: fp32 sums, tf32 products when fp32. The rank tile is
    skipped when it starts at or beyond every token's rank."""
    slice_id = tl.program_id(1)
    pid_n = tl.program_id(2) // SPLIT_K
    pid_k = tl.program_id(2) % SPLIT_K
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_active
    slots = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1)
    active = slots >= 0  # NO_SLOT (-1): a token without an adapter
    rank = tl.load(
        ranks_ptr + slots.to(tl.int64) * stride_rs + slice_id * stride_rl, mask=active, other=0
    )
    if pid_n * BLOCK_N >= tl.max(rank, 0):
        return
    todo = rank > pid_n * BLOCK_N  # tokens whose rank reaches this tile
    rows = tl.load(token_indices_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn_mask = offs_n[None, :] < rank[:, None]
    offs_k = pid_k * k_iters * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(k_iters):
        k_mask = offs_k < hidden
        xt = tl.load(x_ptrs, mask=todo[:, None] & k_mask[None, :], other=0.0)
        if DOT_F32:
            xt = xt.to(tl.float32)
        left = todo
        while tl.sum(left.to(tl.int32), 0) > 0:
            slot = tl.min(tl.where(left, slots, 2147483647), 0)  # the block's next slot
            mine = left & (slots == slot)
            slot_rank = tl.max(tl.where(mine, rank, 0), 0)
            entry = slot.to(tl.int64) * stride_rs + slice_id * stride_rl
            a_start = tl.load(a_offsets_ptr + entry)
            a_ptrs = pool_ptr + a_start + offs_n[None, :] * hidden + offs_k[:, None]  # A^T tile
            at = tl.load(a_ptrs, mask=k_mask[:, None] & (offs_n < slot_rank)[None, :], other=0.0)
            if DOT_F32:
                at = at.to(tl.float32)
            # Other slots' rows are zeros here, so they add 0 x A: nothing, as the pool holds
            # finite weights only (registration refuses any that the dtype turns infinite).
            acc = tl.dot(tl.where(mine[:, None], xt, 0.0).to(at.dtype), at, acc)
            left = left & (slots != slot)
        offs_k += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
    t_ptrs = t_ptr + slice_id * stride_tl + rows[:, None] * stride_tm + offs_n[None, :] * stride_tr
    if SPLIT_K == 1:
        tl.store(t_ptrs, acc, mask=mn_mask)
    else:
        tl.atomic_add(t_ptrs, acc, mask=mn_mask)
