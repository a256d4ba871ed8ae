"""The engine's stacked LoRA layout: every device slot's adapter weights, per layer and group.

The model fuses projections that read the same input into one GEMM, and LoRA follows:

    group     slices        input (H_in)          output (N_total)
    qkv       q, k, v       hidden                (heads + 2 * kv_heads) * head_dim
    o         o             heads * head_dim      hidden
    gate_up   gate, up      hidden                2 * intermediate
    down      down          intermediate          hidden

For one (layer, group), with S device slots, L slices and R the maximum rank:

    lora_a: [S, L, R, H_in]   slice l's A of the adapter in slot s, rows >= its rank zero
    lora_b: [S, N_total, R]   slice l's B (scaling folded) at rows slice_offsets[l]:[l+1],
                              columns >= its rank zero
    ranks:  int32 [S, L]      the adapter's rank for slice l; 0 = not adapted (A and B zero)

so for a token x using slot s, slice l's output gains
    (x @ lora_a[s, l].T) @ lora_b[s, off[l]:off[l+1]].T
and the zero padding makes using R instead of ranks[s, l] give the same result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.errors import RankOverLimit, ShapeMismatch
from loramux.adapters.peft_format import LoraAdapter

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q", "k", "v"),
    "o": ("o",),
    "gate_up": ("gate", "up"),
    "down": ("down",),
}
"""Fused projection groups and their slices, in the order the fused weight concatenates them."""


def slice_offsets(base: BaseModelSpec, group: str) -> tuple[int, ...]:
    """Row offsets of each slice in the group's fused output: L + 1 values from 0 to N_total."""
    offsets = [0]
    for proj in GROUPS[group]:
        offsets.append(offsets[-1] + base.projection_shape(proj).out_features)
    return tuple(offsets)


@dataclass(frozen=True, eq=False)
class StackedLora:
    """The LoRA weights of one (layer, group) for every device slot (see the module docstring)."""

    layer: int
    group: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    ranks: torch.Tensor
    slice_offsets: tuple[int, ...]

    @classmethod
    def allocate(
        cls,
        base: BaseModelSpec,
        layer: int,
        group: str,
        max_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> StackedLora:
        """Zeroed buffers: every slot empty."""
        projections = GROUPS[group]
        in_features = base.projection_shape(projections[0]).in_features
        offsets = slice_offsets(base, group)
        return cls(
            layer=layer,
            group=group,
            lora_a=torch.zeros(
                max_slots, len(projections), max_rank, in_features, dtype=dtype, device=device
            ),
            lora_b=torch.zeros(max_slots, offsets[-1], max_rank, dtype=dtype, device=device),
            ranks=torch.zeros(max_slots, len(projections), dtype=torch.int32, device=device),
            slice_offsets=offsets,
        )

    @property
    def max_rank(self) -> int:
        return self.lora_a.shape[2]

    def write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Put the adapter's pairs for this layer into `slot`; slices it does not adapt get rank 0."""
        self.clear_slot(slot)
        for index, proj in enumerate(GROUPS[self.group]):
            weights = adapter.modules.get((self.layer, proj))
            if weights is None:
                continue
            rank = weights.a.shape[0]
            start, end = self.slice_offsets[index], self.slice_offsets[index + 1]
            self.lora_a[slot, index, :rank].copy_(weights.a, non_blocking=True)
            self.lora_b[slot, start:end, :rank].copy_(weights.b, non_blocking=True)
            self.ranks[slot, index] = rank

    def clear_slot(self, slot: int) -> None:
        """Zero the slot's weights and ranks: it then adds nothing."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.ranks[slot].zero_()


class LoraStack:
    """Every (layer, group)'s `StackedLora` of one base model, sharing S slots of rank R.

    Writes validate first, so a refused adapter leaves every slot as it was.
    """

    def __init__(self, base: BaseModelSpec, groups: dict[tuple[int, str], StackedLora]) -> None:
        self.base = base
        self.groups = groups

    @classmethod
    def allocate(
        cls,
        base: BaseModelSpec,
        max_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> LoraStack:
        """Zeroed buffers for `max_slots` adapters of rank up to `max_rank` on `device`."""
        if max_slots < 1 or max_rank < 1:
            raise ValueError(f"need at least one slot and rank 1, not {max_slots}, {max_rank}")
        groups = {
            (layer, group): StackedLora.allocate(
                base, layer, group, max_slots, max_rank, dtype, device
            )
            for layer in range(base.num_layers)
            for group in GROUPS
        }
        return cls(base, groups)

    @property
    def max_slots(self) -> int:
        return self.groups[0, "qkv"].lora_a.shape[0]

    @property
    def max_rank(self) -> int:
        return self.groups[0, "qkv"].max_rank

    def __getitem__(self, key: tuple[int, str]) -> StackedLora:
        """The stacked weights of (layer, group)."""
        return self.groups[key]

    def write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Load the adapter into `slot` (replacing what was there) in every layer and group."""
        self._check_fits(slot, adapter)
        for stacked in self.groups.values():
            stacked.write_slot(slot, adapter)

    def clear_slot(self, slot: int) -> None:
        """Empty `slot` in every layer and group."""
        self._check_slot(slot)
        for stacked in self.groups.values():
            stacked.clear_slot(slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise IndexError(f"slot {slot} is outside 0..{self.max_slots - 1}")

    def _check_fits(self, slot: int, adapter: LoraAdapter) -> None:
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise RankOverLimit(
                f"rank {adapter.rank} is over the engine's slot rank {self.max_rank}"
            )
        for (layer, proj), weights in adapter.modules.items():
            expected = self.base.projection_shape(proj)
            actual = (weights.a.shape[1], weights.b.shape[0])
            if layer >= self.base.num_layers or actual != expected:
                raise ShapeMismatch(
                    f"adapter {adapter.digest[:12]} does not fit the base model at layer {layer} {proj}"
                )
