"""Plain-torch twins of the multi-LoRA kernels (same signatures, same semantics), and the
engine's CPU serving path.

Every adapter is computed at its own rank, reading its A [r, H] and B [width, r] from the flat
adapter pool at their offsets: nothing outside those regions is read, slices of rank 0 cost
nothing, tokens without an adapter cost nothing. Products accumulate in float32; expand adds
into y in place with one rounding to y's dtype (a DoRA slice: adds, scales, then rounds).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def _matrix(pool: torch.Tensor, start: int, rows: int, cols: int) -> torch.Tensor:
    """The row-major [rows, cols] matrix at element `start` of the pool, as float32."""
    return pool[start : start + rows * cols].view(rows, cols).float()


def sgmv_shrink_ref(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    t: torch.Tensor,
) -> None:
    """Semantics: as ``kernels.lora_shrink.sgmv_shrink``, one matmul per segment and slice:
    for g: for l: t[l, s0:s0+n, :r] = x[s0:s0+n] @ A(slot[g], l).T  with r = ranks[slot[g], l]
    """
    hidden = x.shape[1]
    seg_ranks, seg_offsets = ranks[seg_slots.long()].tolist(), a_offsets[seg_slots.long()].tolist()
    for start, n, slice_ranks, slice_offsets in zip(
        seg_starts.tolist(), seg_lens.tolist(), seg_ranks, seg_offsets, strict=True
    ):
        xs = x[start : start + n].float()
        for slice_idx, (r, a_start) in enumerate(zip(slice_ranks, slice_offsets, strict=True)):
            if r:
                a = _matrix(pool, a_start, r, hidden)
                t[slice_idx, start : start + n, :r] = xs @ a.T


def sgmv_expand_ref(
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
    """Semantics: as ``kernels.lora_expand.sgmv_expand``, one matmul per segment and slice:
    for g: for l: y[s0:s0+n, c0:c1] += t[l, s0:s0+n, :r] @ B(slot[g], l).T
                  then, for a DoRA slice, y[s0:s0+n, c0:c1] *= scale(slot[g], l)
    """
    bounds = list(itertools.pairwise(slice_offsets))
    slots = seg_slots.long()
    seg_ranks, seg_offsets = ranks[slots].tolist(), b_offsets[slots].tolist()
    seg_scales = (
        scale_offsets[slots].tolist()
        if scale_offsets is not None
        else [[-1] * len(bounds)] * len(slots)
    )
    for start, n, slice_ranks, slice_starts, scale_starts in zip(
        seg_starts.tolist(), seg_lens.tolist(), seg_ranks, seg_offsets, seg_scales, strict=True
    ):
        for slice_idx, ((c0, c1), r, b_start, scale_start) in enumerate(
            zip(bounds, slice_ranks, slice_starts, scale_starts, strict=True)
        ):
            if not r:
                continue
            b = _matrix(pool, b_start, c1 - c0, r)
            delta = t[slice_idx, start : start + n, :r] @ b.T
            out = y[start : start + n, c0:c1]
            if scale_start < 0:
                out += delta  # a float32 operand: computed in float32, rounded once into y
            else:
                scale = pool[scale_start : scale_start + c1 - c0].float()
                out.copy_((out.float() + delta) * scale)


def _slot_runs(
    token_indices: torch.Tensor, token_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The listed tokens that have a slot (not NO_SLOT, -1), ordered by slot: (their rows as
    int64, and seg_starts, seg_lens, seg_slots of the runs that ordering forms, one per slot)."""
    adapted = token_slots >= 0
    token_indices, token_slots = token_indices[adapted], token_slots[adapted]
    order = torch.argsort(token_slots, stable=True)
    seg_slots, seg_lens = torch.unique_consecutive(token_slots[order], return_counts=True)
    return token_indices[order].long(), torch.cumsum(seg_lens, 0) - seg_lens, seg_lens, seg_slots


# The per-token twins order tokens by slot and run the segmented twins: one matmul per slot
# and slice, no work on rank padding. Measured against gathering A and B per token plus bmm
# (one thread of a busy 2-core machine; 64 decode tokens drawn over 64 slots, H 256, R 64,
# L 3): shrink 1.8 vs 3.5 ms, expand 1.9 vs 1.7 ms; at 256 tokens 2.9 vs 45 ms and 3.2 vs
# 7.2 ms, as gathering copies every token's weights.


def bgmv_shrink_ref(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    token_indices: torch.Tensor,
    token_slots: torch.Tensor,
    t: torch.Tensor,
) -> None:
    """Semantics: as ``kernels.lora_shrink.bgmv_shrink``; tokens grouped by slot:
    for slot: for l: t[l, rows, :r] = x[rows] @ A(slot, l).T  with r = ranks[slot, l]
    """
    rows, seg_starts, seg_lens, seg_slots = _slot_runs(token_indices, token_slots)
    num_slices, _, max_rank = t.shape
    grouped = torch.zeros(num_slices, rows.shape[0], max_rank, device=t.device)
    sgmv_shrink_ref(x[rows], pool, a_offsets, ranks, seg_starts, seg_lens, seg_slots, grouped)
    token_ranks = ranks[seg_slots].repeat_interleave(seg_lens, dim=0)
    written = torch.arange(max_rank, device=t.device) < token_ranks.T[:, :, None]
    t[:, rows] = torch.where(written, grouped, t[:, rows])


def bgmv_expand_ref(
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
    """Semantics: as ``kernels.lora_expand.bgmv_expand``; tokens grouped by slot:
    for slot: for l: y[rows, c0:c1] += t[l, rows, :r] @ B(slot, l).T, then scaled for DoRA
    """
    rows, seg_starts, seg_lens, seg_slots = _slot_runs(token_indices, token_slots)
    grouped = y[rows]
    sgmv_expand_ref(
        t[:, rows],
        pool,
        b_offsets,
        slice_offsets,
        ranks,
        seg_starts,
        seg_lens,
        seg_slots,
        grouped,
        scale_offsets,
    )
    y[rows] = grouped
