"""One step's LoRA work: the order its chunks run in, which tokens use which slot, and the
kernel calls that add the deltas.

`order_by_adapter` puts a step's chunks in adapter-slot order, so each adapter's tokens form one
segment. Decode-only steps use the per-token kernels (BGMV), others the segmented ones (SGMV).
On CUDA these are the Triton kernels; elsewhere their torch twins, the CPU serving path. A step
replayed as a CUDA graph lists every row of the graph's batch, padding and base-model rows with
no slot (kernels.lora_meta's padded layout), so the kernels' grid is the graph's.

Chunks whose adapter is still being copied into its slot come after the slotted ones, grouped by
adapter, and their LoRA work is the host path's (engine.lora.host_path); such a step never
replays a graph (the runner checks `needs_eager`), nor does one with an adapter that changes the
token embedding. Embedding and lm_head weights are engine.lora.top_modules' work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loramux.adapters.layout import GROUPS, LoraStack
from loramux.adapters.peft_format import LoraAdapter
from loramux.engine.lora.host_path import HostLoraPath, HostRun
from loramux.engine.lora.manager import LoraManager
from loramux.engine.lora.top_modules import TopRun, apply_embedding, apply_logits
from loramux.engine.scheduler import ScheduledChunk
from loramux.kernels.lora_expand import bgmv_expand, sgmv_expand
from loramux.kernels.lora_meta import LoraBatchMeta, LoraMetaBuffers
from loramux.kernels.lora_ref import sgmv_expand_ref, sgmv_shrink_ref
from loramux.kernels.lora_shrink import bgmv_shrink, sgmv_shrink


class LoraBatch:
    """Implements the model's `LoraApplier` for one step."""

    def __init__(
        self,
        stack: LoraStack,
        meta: LoraBatchMeta | None,
        per_token: bool,
        host: HostLoraPath | None = None,
        top: list[TopRun] | None = None,
    ):
        self.stack = stack
        self.meta = meta
        """The slotted tokens; None when every adapted token takes the host path."""
        self.per_token = per_token
        self.host = host
        self.top = top or []
        """Runs of tokens whose adapter has embedding or lm_head weights."""

    @classmethod
    def build(
        cls,
        stack: LoraStack,
        buffers: LoraMetaBuffers,
        token_slots: Sequence[int | None],
        per_token: bool,
        pad_to: int | None = None,
        host: HostLoraPath | None = None,
        top: list[TopRun] | None = None,
    ) -> LoraBatch | None:
        """None when no token of the step uses an adapter: the step then costs no LoRA work.
        With `pad_to` (a CUDA graph's batch) there is always a batch, in the padded layout."""
        if pad_to is not None:
            assert host is None, "a graph replay cannot run the host path"
            return cls(stack, buffers.build(token_slots, pad_to), per_token=True, top=top)
        slotted = any(s is not None for s in token_slots)
        if not slotted and host is None and not top:
            return None
        meta = buffers.build(token_slots) if slotted else None
        return cls(stack, meta, per_token, host, top)

    def embed(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        apply_embedding([r for r in self.top if r.weights.adapts_embedding], input_ids, x)

    def adjust_logits(
        self, logits_indices: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor
    ) -> None:
        """Apply lm_head weights to the logits of the sampled rows (after the forward pass)."""
        apply_logits(self.top, logits_indices, hidden, logits)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.host is not None:
            self.host.apply(layer, group, x, y)
        if self.meta is not None:
            self._apply_slotted(layer, group, x, y, self.meta)

    def _apply_slotted(
        self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, m: LoraBatchMeta
    ) -> None:
        stacked = self.stack[layer, group]
        num_slices = stacked.ranks.shape[1]
        t = torch.zeros(
            num_slices, x.shape[0], self.stack.max_rank, dtype=torch.float32, device=x.device
        )
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
                stacked.scale_offsets,
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
                stacked.scale_offsets,
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
    hosts = {id(c): manager.host_adapter(c.seq.adapter_id) for c in chunks}

    def place(c: ScheduledChunk) -> tuple[int, int, str]:
        slot, host = slots[id(c)], hosts[id(c)]
        if slot is not None:
            return (0, slot, "")
        return (1, 0, host.digest) if host is not None else (2, 0, "")

    ordered = sorted(chunks, key=place)
    token_slots = [slots[id(c)] for c in ordered for _ in range(c.num_tokens)]
    per_token = all(c.num_tokens == 1 for c in ordered)
    host = _host_path(ordered, hosts, manager)
    top = _top_runs(ordered, manager)
    batch = LoraBatch.build(manager.stack, buffers, token_slots, per_token, pad_to, host, top)
    return LoraStep(ordered, batch)


def needs_eager(chunks: list[ScheduledChunk], manager: LoraManager | None) -> bool:
    """The step's forward pass does Python LoRA work a CUDA graph would not capture: some
    chunk's adapter is still being copied into its slot, or changes the token embedding."""
    if manager is None:
        return False
    for c in chunks:
        digest = c.seq.adapter_id
        top = manager.top_weights(digest)
        if manager.host_adapter(digest) is not None or (top is not None and top.adapts_embedding):
            return True
    return False


def _top_runs(ordered: list[ScheduledChunk], manager: LoraManager) -> list[TopRun]:
    """Runs of the ordered chunks' token rows whose adapter has embedding or lm_head weights."""
    runs: list[TopRun] = []
    row = 0
    for c in ordered:
        weights = manager.top_weights(c.seq.adapter_id)
        if weights is not None:
            if runs and runs[-1].weights is weights and runs[-1].end == row:
                runs[-1] = TopRun(weights, runs[-1].start, row + c.num_tokens)
            else:
                runs.append(TopRun(weights, row, row + c.num_tokens))
        row += c.num_tokens
    return runs


def _host_path(
    ordered: list[ScheduledChunk], hosts: dict[int, LoraAdapter | None], manager: LoraManager
) -> HostLoraPath | None:
    """The host-path runs of the ordered chunks (one per adapter), counted per adapter."""
    runs: list[HostRun] = []
    row = 0
    for c in ordered:
        adapter = hosts[id(c)]
        if adapter is not None:
            if runs and runs[-1].adapter is adapter and runs[-1].end == row:
                runs[-1] = HostRun(adapter, runs[-1].start, row + c.num_tokens)
            else:
                runs.append(HostRun(adapter, row, row + c.num_tokens))
            manager.count_host_path(adapter.digest, c.num_tokens)
        row += c.num_tokens
    if not runs:
        return None
    offsets = {group: manager.stack[0, group].slice_offsets for group in GROUPS}
    return HostLoraPath(runs, offsets)
