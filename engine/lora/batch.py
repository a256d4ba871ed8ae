"""One step's LoRA work: the order its chunks run in, which tokens use which slot, and the
kernel calls that add the deltas.

`order_by_adapter` puts a step's chunks in adapter-slot order, so each adapter's tokens form one
segment. Decode-only steps use the per-token kernels (BGMV), others the segmented ones (SGMV).
On CUDA these are the Triton kernels; elsewhere their torch twins, the CPU serving path. A step
replayed as a CUDA graph lists every row of the graph's batch, padding and base-model rows with
no slot (kernels.lora_meta's padded layout), so the kernels' grid is the graph's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loramux.adapters.layout import LoraStack
from loramux.engine.lora.manager import LoraManager
from loramux.engine.scheduler import ScheduledChunk
from loramux.kernels.lora_expand import bgmv_expand, sgmv_expand
from loramux.kernels.lora_meta import LoraBatchMeta, LoraMetaBuffers
from loramux.kernels.lora_ref import sgmv_expand_ref, sgmv_shrink_ref
from loramux.kernels.lora_shrink import bgmv_shrink, sgmv_shrink


class LoraBatch:
    """Implements the model's `LoraApplier` for one step."""

    def __init__(self, stack: LoraStack, meta: LoraBatchMeta, per_token: bool):
        self.stack = stack
        self.meta = meta
        self.per_token = per_token

    @classmethod
    def build(
        cls,
        stack: LoraStack,
        buffers: LoraMetaBuffers,
        token_slots: Sequence[int | None],
        per_token: bool,
        pad_to: int | None = None,
    ) -> LoraBatch | None:
        """None when no token of the step uses an adapter: the step then costs no LoRA work.
        With `pad_to` (a CUDA graph's batch) there is always a batch, in the padded layout."""
        if pad_to is not None:
            return cls(stack, buffers.build(token_slots, pad_to), per_token=True)
        if all(s is None for s in token_slots):
            return None
        return cls(stack, buffers.build(token_slots), per_token)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        stacked = self.stack[layer, group]
        num_slices = stacked.ranks.shape[1]
        t = torch.zeros(
            num_slices, x.shape[0], self.stack.max_rank, dtype=torch.float32, device=x.device
        )
        m = self.meta
        on_gpu = x.is_cuda
        # The runner orders tokens by slot, so on the CPU the segmented twins serve decodes too
        # (the per-token twins would regroup them first); per-token kernels pay off on a GPU.
        if self.per_token and on_gpu:
            bgmv_shrink(
                x, stacked.pool, stacked.a_offsets, stacked.ranks, m.token_indices, m.token_slots, t
            )
            bgmv_expand(
                t,
                stacked.pool,
                stacked.b_offsets,
                stacked.slice_offsets,
                stacked.ranks,
                m.token_indices,
                m.token_slots,
                y,
            )
        else:
            seg_shrink = sgmv_shrink if on_gpu else sgmv_shrink_ref
            seg_expand = sgmv_expand if on_gpu else sgmv_expand_ref
            seg_shrink(
                x,
                stacked.pool,
                stacked.a_offsets,
                stacked.ranks,
                m.seg_starts,
                m.seg_lens,
                m.seg_slots,
                t,
            )
            seg_expand(
                t,
                stacked.pool,
                stacked.b_offsets,
                stacked.slice_offsets,
                stacked.ranks,
                m.seg_starts,
                m.seg_lens,
                m.seg_slots,
                y,
            )


@dataclass(frozen=True)
class LoraStep:
    chunks: list[ScheduledChunk]
    """The step's chunks in the order they run: by adapter slot, base-model chunks last."""
    batch: LoraBatch | None
    """The LoRA work of the step; None when no chunk uses an adapter."""


def order_by_adapter(
    chunks: list[ScheduledChunk],
    manager: LoraManager | None,
    buffers: LoraMetaBuffers,
    pad_to: int | None = None,
) -> LoraStep:
    """Order the step's chunks by adapter slot (one segment per adapter) and build its LoRA
    work; `pad_to`: the batch of the CUDA graph the step replays."""
    if manager is None:
        return LoraStep(chunks, None)
    slots = {id(c): manager.slot_of(c.seq.adapter_id) for c in chunks}
    ordered = sorted(chunks, key=lambda c: (slots[id(c)] is None, slots[id(c)] or 0))
    token_slots = [slots[id(c)] for c in ordered for _ in range(c.num_tokens)]
    per_token = all(c.num_tokens == 1 for c in ordered)
    batch = LoraBatch.build(manager.stack, buffers, token_slots, per_token, pad_to)
    return LoraStep(ordered, batch)
