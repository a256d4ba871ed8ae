"""Per-step LoRA batch metadata: which tokens use which adapter slot, in the two layouts the
multi-LoRA kernels read (segments for SGMV, per-token lists for BGMV), and the launch sizing
both kernel families share.

A batch is described by one adapter slot per token, or None for a token served by the base
model alone. Worked example, slots a=3, b=7, tokens ``[a a a - b b a]`` ('-' is None):

    seg_starts    [0, 4, 6]         seg_lens    [3, 2, 1]     seg_slots   [3, 7, 3]
    token_indices [0, 1, 2, 4, 5, 6]                          token_slots [3, 3, 3, 7, 7, 3]

A segment is a maximal run of consecutive tokens with the same slot, so the engine orders a
step's tokens by adapter to get one segment per adapter; an adapter split over two runs is two
segments, which the kernels accept. There are never more segments than tokens, so one capacity
(``max_tokens``) bounds all five arrays.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
"""True when Triton kernels run under the CPU interpreter: kernels then cast tl.dot inputs to
float32 (bf16 dots are wrong there) and launches pick large tiles (cost grows per program)."""


@dataclass(frozen=True)
class LoraBatchMeta:
    """One step's token-to-slot mapping in both layouts; every field int32 on the kernels'
    device, a view into ``LoraMetaBuffers`` storage that stays valid until its next ``build``.

    Invariants: segments are disjoint runs in token order with ``seg_lens >= 1``; a token with
    no adapter appears in no segment and not in ``token_indices``.
    """

    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor
    token_indices: torch.Tensor
    token_slots: torch.Tensor

    @property
    def num_segments(self) -> int:
        return self.seg_starts.shape[0]

    @property
    def num_adapter_tokens(self) -> int:
        return self.token_indices.shape[0]


class LoraMetaBuffers:
    """Preallocated storage for ``LoraBatchMeta``, on the host (pinned when the device is CUDA)
    and on the device: 5 x ``max_tokens`` int32 each (8192 tokens: 160 KiB). A build packs
    seg_starts, seg_lens, seg_slots (G each) and token_indices, token_slots (T' each) back to
    back, 3G + 2T' <= 5 x max_tokens, and issues one asynchronous copy of that prefix; the
    next build waits for the copy before it rewrites the host buffer.
    """

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        on_cuda = device.type == "cuda"
        self._host = torch.zeros(5 * max_tokens, dtype=torch.int32, pin_memory=on_cuda)
        self._device = torch.zeros_like(self._host, device=device) if on_cuda else self._host
        self._copied = torch.cuda.Event() if on_cuda else None

    def build(self, token_slots: Sequence[int | None]) -> LoraBatchMeta:
        """The metadata for a step whose token i uses adapter slot ``token_slots[i]``."""
        if len(token_slots) > self.max_tokens:
            raise ValueError(f"{len(token_slots)} tokens exceed the capacity of {self.max_tokens}")
        # -1 marks "no adapter" only inside this computation; slots are never negative.
        slots = torch.tensor([-1 if s is None else s for s in token_slots], dtype=torch.int32)
        active = slots >= 0
        edge = torch.tensor([-1], dtype=torch.int32)
        seg_starts = (active & (slots != torch.cat([edge, slots[:-1]]))).nonzero().flatten()
        seg_ends = (active & (slots != torch.cat([slots[1:], edge]))).nonzero().flatten()
        token_indices = active.nonzero().flatten()
        rows = (
            seg_starts,
            seg_ends - seg_starts + 1,
            slots[seg_starts],
            token_indices,
            slots[token_indices],
        )
        used = sum(row.shape[0] for row in rows)
        if self._copied is not None:
            self._copied.synchronize()
        torch.cat(rows, out=self._host[:used])
        if self._copied is not None:
            self._device[:used].copy_(self._host[:used], non_blocking=True)
            self._copied.record()
        views = self._device[:used].split([row.shape[0] for row in rows])
        return LoraBatchMeta(*views)


def pow2_clamp(n: int, low: int, high: int) -> int:
    """The power of two at or above ``n``, clamped to [low, high] (both powers of two)."""
    return max(low, min(high, triton.next_power_of_2(max(n, 1))))


def segment_block_m(num_tokens: int, num_segments: int) -> int:
    """Tokens per tile for segmented kernels: on a GPU about the mean segment length, 16 (the
    tl.dot minimum) to 64; 128 under the interpreter, whose cost grows with executed tiles."""
    if INTERPRET:
        return 128
    return pow2_clamp(triton.cdiv(num_tokens, max(num_segments, 1)), 16, 64)


def segment_tile_bound(num_tokens: int, num_segments: int, block_m: int) -> int:
    """Upper bound on sum_g cdiv(seg_lens[g], block_m) when sum_g seg_lens[g] <= num_tokens:
    the size of the grid axis that ``locate_segment_tile`` maps onto (segment, tile) pairs."""
    return triton.cdiv(num_tokens, block_m) + num_segments


def segments_pad(num_segments: int) -> int:
    """Power-of-two vector length holding all segment lengths (few distinct compilations)."""
    return pow2_clamp(num_segments, 16, 1 << 30)


@triton.jit
def locate_segment_tile(
    seg_lens_ptr, num_segs, tile, BLOCK_M: tl.constexpr, SEGS_PAD: tl.constexpr
):
    """Map a flat tile index onto (segment g, tile index within g, seg_lens[g]).

    Segment g owns cdiv(seg_lens[g], BLOCK_M) consecutive tiles; g == num_segs when ``tile``
    lies beyond all of them (the program has no work).
    """
    offs = tl.arange(0, SEGS_PAD)
    lens = tl.load(seg_lens_ptr + offs, mask=offs < num_segs, other=0)
    tiles = (lens + BLOCK_M - 1) // BLOCK_M
    before = tl.cumsum(tiles, 0) <= tile  # segments whose tiles all precede this one
    g = tl.sum(before.to(tl.int32), 0)
    begin = tl.sum(tl.where(before, tiles, 0), 0)
    seg_len = tl.load(seg_lens_ptr + g, mask=g < num_segs, other=0)
    return g, tile - begin, seg_len
