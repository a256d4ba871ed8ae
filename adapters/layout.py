"""The engine's adapter memory: one flat pool of weights, and per (layer, group) a table saying
where each resident adapter's pairs lie in it.

The model fuses projections that read the same input into one GEMM, and LoRA follows:

    group     slices        input (H_in)          output (N_total)
    qkv       q, k, v       hidden                (heads + 2 * kv_heads) * head_dim
    o         o             heads * head_dim      hidden
    gate_up   gate, up      hidden                2 * intermediate
    down      down          intermediate          hidden

Every resident adapter holds one contiguous *region* of the pool, sized by its own ranks:
for every module it adapts, A [r, H_in] then B [N_slice, r] (scaling folded), row-major, then
for DoRA the output's per-channel scale [N_slice] (adapters.dora). A
rank-8 adapter therefore takes an eighth of a rank-64 one's memory, and the number of resident
adapters follows the memory budget. Regions are addressed by a *slot*: a row of the tables,
one per resident adapter (S rows: a bound on resident adapters, cheap metadata).

For one (layer, group), with L slices:

    a_offsets: int64 [S, L]   element offset of slice l's A in the pool
    b_offsets: int64 [S, L]   element offset of slice l's B in the pool
    ranks:     int32 [S, L]   the adapter's rank for slice l; 0 = not adapted (offsets unused)
    scale_offsets: int64 [S, L]  element offset of slice l's DoRA scale; -1 = plain LoRA

so for a token x using slot s, slice l's output y becomes, with r = ranks[s, l],
    y + (x @ A.T) @ B.T,  A = pool[a_offsets[s, l]:][:r * H_in].view(r, H_in),
                          B = pool[b_offsets[s, l]:][:N_slice * r].view(N_slice, r)
and with DoRA  (y + (x @ A.T) @ B.T) * pool[scale_offsets[s, l]:][:N_slice].

After its (layer, group) blocks, an adapter's region holds its token-embedding and lm_head
weights, if any: LoRA pairs (A, B) then saved copies (adapters.peft_top). No kernel reads them:
`TopTable` keeps, per slot, views of them in the pool (`TopWeights`), which the embedding and
logits steps use directly (engine.lora.top_modules).
Which region an adapter gets is the caller's choice (engine.lora.memory allocates them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.errors import RankOverLimit, ShapeMismatch
from loramux.adapters.peft_format import LoraAdapter
from loramux.adapters.weights import LoraWeights

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
    """Where every slot's pairs of one (layer, group) lie in the pool (see the module docstring)."""

    layer: int
    group: str
    pool: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    scale_offsets: torch.Tensor
    slice_offsets: tuple[int, ...]
    in_features: int

    @classmethod
    def allocate(
        cls, base: BaseModelSpec, layer: int, group: str, max_slots: int, pool: torch.Tensor
    ) -> StackedLora:
        """Zeroed tables: every slot empty."""
        projections = GROUPS[group]

        def table(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_slots, len(projections), dtype=dtype, device=pool.device)

        return cls(
            layer=layer,
            group=group,
            pool=pool,
            a_offsets=table(torch.int64),
            b_offsets=table(torch.int64),
            ranks=table(torch.int32),
            scale_offsets=table(torch.int64).fill_(-1),
            slice_offsets=slice_offsets(base, group),
            in_features=base.projection_shape(projections[0]).in_features,
        )

    def a_of(self, slot: int, index: int) -> torch.Tensor:
        """Slice `index`'s A in `slot`: a [r, H_in] view of the pool."""
        rank, start = int(self.ranks[slot, index]), int(self.a_offsets[slot, index])
        return self.pool[start : start + rank * self.in_features].view(rank, self.in_features)

    def b_of(self, slot: int, index: int) -> torch.Tensor:
        """Slice `index`'s B in `slot`: a [N_slice, r] view of the pool."""
        rank, start = int(self.ranks[slot, index]), int(self.b_offsets[slot, index])
        width = self.slice_offsets[index + 1] - self.slice_offsets[index]
        return self.pool[start : start + width * rank].view(width, rank)

    def write_slot(self, slot: int, adapter: LoraAdapter, start: int) -> int:
        """Copy the adapter's weights for this (layer, group) into the pool from element `start`
        and point `slot` at them; slices it does not adapt get rank 0. Returns the end."""
        self.clear_slot(slot)
        for index, proj in enumerate(GROUPS[self.group]):
            weights = adapter.modules.get((self.layer, proj))
            if weights is None:
                continue
            offsets = []
            for tensor in weights.tensors():
                offsets.append(start)
                end = start + tensor.numel()
                self.pool[start:end].view_as(tensor).copy_(tensor, non_blocking=True)
                start = end
            self.a_offsets[slot, index], self.b_offsets[slot, index] = offsets[:2]
            if weights.scale is not None:
                self.scale_offsets[slot, index] = offsets[2]
            self.ranks[slot, index] = weights.a.shape[0]
        return start

    def elements(self, adapter: LoraAdapter) -> int:
        """Pool elements the adapter's weights for this (layer, group) take."""
        return sum(
            t.numel()
            for proj in GROUPS[self.group]
            if (w := adapter.modules.get((self.layer, proj))) is not None
            for t in w.tensors()
        )

    def clear_slot(self, slot: int) -> None:
        """Point `slot` at nothing: it then adds nothing (its pool region is left as it was)."""
        self.a_offsets[slot].zero_()
        self.b_offsets[slot].zero_()
        self.ranks[slot].zero_()
        self.scale_offsets[slot].fill_(-1)


@dataclass(frozen=True)
class TopWeights:
    """An adapter's embedding and lm_head weights (LoRA pairs and saved copies, by module), in
    the pool or in its host copy."""

    top: dict[str, LoraWeights]
    saved: dict[str, torch.Tensor]

    @classmethod
    def of(cls, adapter: LoraAdapter) -> TopWeights | None:
        """The adapter's own (host) weights; None when it has none."""
        if not (adapter.top or adapter.saved):
            return None
        return cls(dict(adapter.top), dict(adapter.saved))

    @property
    def adapts_embedding(self) -> bool:
        return "embed_tokens" in self.top or "embed_tokens" in self.saved


TOP_BLOCK = (-1, "top")
"""The block key of a region's embedding and lm_head part (engine.lora.slot_copy)."""


class TopTable:
    """Per slot, where its adapter's embedding and lm_head weights lie in the pool."""

    def __init__(self, pool: torch.Tensor, max_slots: int) -> None:
        self.pool = pool
        self.entries: list[TopWeights | None] = [None] * max_slots

    @staticmethod
    def elements(adapter: LoraAdapter) -> int:
        return sum(t.numel() for w in adapter.top.values() for t in w.tensors()) + sum(
            t.numel() for t in adapter.saved.values()
        )

    def write_slot(self, slot: int, adapter: LoraAdapter, start: int) -> int:
        """Copy the adapter's embedding and lm_head weights into the pool from `start` (in
        `LoraAdapter.flat_tensors` order) and point `slot` at them. Returns the end."""

        def place(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal start
            view = self.pool[start : start + tensor.numel()].view_as(tensor)
            view.copy_(tensor, non_blocking=True)
            start += tensor.numel()
            return view

        top = {m: LoraWeights(place(w.a), place(w.b)) for m, w in sorted(adapter.top.items())}
        saved = {m: place(t) for m, t in sorted(adapter.saved.items())}
        self.entries[slot] = TopWeights(top, saved) if (top or saved) else None
        return start

    def clear_slot(self, slot: int) -> None:
        self.entries[slot] = None


class LoraStack:
    """The pool of one base model's adapter weights and every (layer, group)'s `StackedLora`.

    Writes validate first, so a refused adapter leaves every slot and region as it was.
    """

    def __init__(
        self,
        base: BaseModelSpec,
        pool: torch.Tensor,
        groups: dict[tuple[int, str], StackedLora],
        max_rank: int,
    ) -> None:
        self.base = base
        self.pool = pool
        self.groups = groups
        self.max_rank = max_rank
        self.top = TopTable(pool, self.max_slots)

    @classmethod
    def allocate(
        cls,
        base: BaseModelSpec,
        max_slots: int,
        max_rank: int,
        pool_elements: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> LoraStack:
        """A zeroed pool of `pool_elements` weights and tables for `max_slots` adapters of
        rank up to `max_rank` on `device`."""
        if max_slots < 1 or max_rank < 1 or pool_elements < 1:
            raise ValueError(
                f"need a slot, rank 1 and pool memory, not {max_slots}, {max_rank}, {pool_elements}"
            )
        pool = torch.zeros(pool_elements, dtype=dtype, device=device)
        groups = {
            (layer, group): StackedLora.allocate(base, layer, group, max_slots, pool)
            for layer in range(base.num_layers)
            for group in GROUPS
        }
        return cls(base, pool, groups, max_rank)

    @staticmethod
    def full_rank_elements(base: BaseModelSpec, rank: int) -> int:
        """Pool elements of an adapter of `rank` on every projection of every layer: the most
        one adapter can need."""
        per_layer = 0
        for projections in GROUPS.values():
            for proj in projections:
                shape = base.projection_shape(proj)
                per_layer += rank * (shape.in_features + shape.out_features)
        return per_layer * base.num_layers

    @staticmethod
    def region_elements(adapter: LoraAdapter) -> int:
        """Pool elements the adapter's region takes: its pairs at their own ranks (and scales),
        and its embedding and lm_head weights."""
        return sum(t.numel() for t in adapter.flat_tensors())

    @property
    def max_slots(self) -> int:
        return self.groups[0, "qkv"].ranks.shape[0]

    @property
    def pool_elements(self) -> int:
        return self.pool.shape[0]

    def __getitem__(self, key: tuple[int, str]) -> StackedLora:
        """The tables of (layer, group)."""
        return self.groups[key]

    def block_starts(self, adapter: LoraAdapter, start: int) -> list[tuple[tuple[int, str], int]]:
        """Where each (layer, group)'s part of the adapter's region begins, for a region from
        element `start`, in the order `write_slot` lays them out: blocks may then be written
        one at a time (engine.lora.slot_copy)."""
        self._check_fits(0, adapter, start)
        starts = []
        for key, stacked in self.groups.items():
            starts.append((key, start))
            start += stacked.elements(adapter)
        if TopTable.elements(adapter):
            starts.append((TOP_BLOCK, start))
        return starts

    def write_block(
        self, slot: int, key: tuple[int, str], adapter: LoraAdapter, start: int
    ) -> None:
        """Write one block of `block_starts` (a (layer, group) or TOP_BLOCK) into `slot`."""
        table = self.top if key == TOP_BLOCK else self.groups[key]
        table.write_slot(slot, adapter, start)

    def write_slot(self, slot: int, adapter: LoraAdapter, start: int) -> None:
        """Copy the adapter into the region from element `start` (`region_elements` long) and
        point `slot` at it in every layer and group, replacing what the slot held."""
        self._check_fits(slot, adapter, start)
        for stacked in self.groups.values():
            start = stacked.write_slot(slot, adapter, start)
        self.top.write_slot(slot, adapter, start)

    def clear_slot(self, slot: int) -> None:
        """Empty `slot` in every layer and group."""
        self._check_slot(slot)
        for stacked in self.groups.values():
            stacked.clear_slot(slot)
        self.top.clear_slot(slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise IndexError(f"slot {slot} is outside 0..{self.max_slots - 1}")

    def _check_fits(self, slot: int, adapter: LoraAdapter, start: int) -> None:
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise RankOverLimit(f"rank {adapter.rank} is over the engine's rank {self.max_rank}")
        for (layer, proj), weights in adapter.modules.items():
            expected = self.base.projection_shape(proj)
            actual = (weights.a.shape[1], weights.b.shape[0])
            # A DoRA adapter loaded without the base weights has no scales: not servable.
            assert (weights.scale is not None) == adapter.use_dora, "DoRA scales missing"
            scale_fits = weights.scale is None or weights.scale.shape == (expected.out_features,)
            if layer >= self.base.num_layers or actual != expected or not scale_fits:
                raise ShapeMismatch(
                    f"adapter {adapter.digest[:12]} does not fit the base model at layer {layer} {proj}"
                )
        vocab, hidden = self.base.vocab, self.base.hidden_size
        top_shapes = {"embed_tokens": (vocab, hidden), "lm_head": (hidden, vocab)}
        for module, weights in adapter.top.items():
            if (weights.a.shape[1], weights.b.shape[0]) != top_shapes[module]:
                raise ShapeMismatch(f"adapter {adapter.digest[:12]}'s {module} does not fit")
        if any(t.shape != (vocab, hidden) for t in adapter.saved.values()):
            raise ShapeMismatch(f"adapter {adapter.digest[:12]}'s saved modules do not fit")
        end = start + self.region_elements(adapter)
        if not 0 <= start <= end <= self.pool_elements:
            raise IndexError(f"region {start}..{end} is outside the pool of {self.pool_elements}")
