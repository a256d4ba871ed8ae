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

Padded per-token layout (``pad_to``, for a CUDA graph captured at a batch size): every row is
listed, padding included, and rows without an adapter carry NO_SLOT, which the per-token
kernels skip. For the example padded to 8:

    token_indices [0, 1, 2, 3, 4, 5, 6, 7]    token_slots [3, 3, 3, -1, 7, 7, 3, -1]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NO_SLOT = -1
"""A per-token kernel's slot for a token served by the base model alone: no work for it."""

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"
"""True when Triton kernels run under the CPU interpreter: kernels then cast tl.dot inputs to
float32 (bf16 dots are wrong there) and launches pick large tiles (cost grows per program)."""


@dataclass(frozen=True)
class LoraBatchMeta:
    """One step's token-to-slot mapping in both layouts; every field int32 on the kernels'
    device, a view into ``LoraMetaBuffers`` storage that stays valid until its next ``build``.

    Invariants: segments are disjoint runs in token order with ``seg_lens >= 1``; a token with
    no adapter appears in no segment, and in ``token_indices`` only in the padded layout, with
    slot NO_SLOT.
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
    and on the device: 5 x ``max_tokens`` int32 each (8192 tokens: 160 KiB). token_indices
    lives at [0, T), token_slots at [T, 2T) — the same addresses every step, which CUDA graphs
    need — and seg_starts, seg_lens, seg_slots (G each) are packed from 2T. A build issues one
    asynchronous copy per used range; the next build waits for them before it rewrites the
    host buffer.
    """

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        on_cuda = device.type == "cuda"
        self._host = torch.zeros(5 * max_tokens, dtype=torch.int32, pin_memory=on_cuda)
        self._device = torch.zeros_like(self._host, device=device) if on_cuda else self._host
        self._copied = torch.cuda.Event() if on_cuda else None

    def build(self, token_slots: Sequence[int | None], pad_to: int | None = None) -> LoraBatchMeta:
        """The metadata for a step whose token i uses adapter slot ``token_slots[i]``; with
        ``pad_to``, the padded per-token layout of that many rows (see the module docstring)."""
        assert pad_to is None or pad_to >= len(token_slots), "padding cannot drop tokens"
        rows = max(len(token_slots), pad_to or 0)
        if rows > self.max_tokens:
            raise ValueError(f"{rows} tokens exceed the capacity of {self.max_tokens}")
        slots = torch.tensor([NO_SLOT if s is None else s for s in token_slots], dtype=torch.int32)
        active = slots >= 0
        edge = torch.tensor([NO_SLOT], dtype=torch.int32)
        seg_starts = (active & (slots != torch.cat([edge, slots[:-1]]))).nonzero().flatten()
        seg_ends = (active & (slots != torch.cat([slots[1:], edge]))).nonzero().flatten()
        segments = torch.cat([seg_starts, seg_ends - seg_starts + 1, slots[seg_starts]])
        if pad_to is None:
            token_indices = active.nonzero().flatten()
            per_token = slots[token_indices]
        else:
            token_indices = torch.arange(pad_to)
            per_token = torch.cat([slots, torch.full((pad_to - len(slots),), NO_SLOT)])
        t, n, g = self.max_tokens, token_indices.shape[0], seg_starts.shape[0]
        used = [(0, token_indices), (t, per_token), (2 * t, segments)]
        if self._copied is not None:
            self._copied.synchronize()
        for start, values in used:
            self._host[start : start + values.shape[0]] = values
            if self._copied is not None:
                end = start + values.shape[0]
                self._device[start:end].copy_(self._host[start:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        d = self._device
        seg = d[2 * t : 2 * t + 3 * g].split([g, g, g])
        return LoraBatchMeta(seg[0], seg[1], seg[2], d[:n], d[t : t + n])


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
