"""LoRA computed from an adapter's host copy, for tokens whose adapter is still on its way
into a device slot (the CaraServe idea): such requests start at once instead of waiting.

For one (layer, group) and a run of rows using adapter W, each slice l the adapter targets adds

    y[rows, off[l]:off[l+1]] += (x[rows] @ W.a.T) @ W.b.T        (float32, scaling in W.b)

and a DoRA module then scales those columns by W.scale (adapters.dora), as the kernels do.
the same product the device kernels compute from the slot, so a request's output does not
depend on which path served which of its steps. On the CPU the host copy is already where the
activations are; on CUDA the rows travel to the host and back, which only pays while the side
stream's copy is still running.

Only LoRA and DoRA on the attention and MLP projections are served this way. Adapter kinds
with more (embedding or lm_head LoRA) are not: whoever adds them must keep such adapters off
this path (their requests wait, LOADING, until the device copy completes) or extend `apply`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.adapters.layout import GROUPS
from loramux.adapters.peft_format import LoraAdapter


@dataclass(frozen=True)
class HostRun:
    """Rows [start, end) of the step's tokens use `adapter`, from its host copy."""

    adapter: LoraAdapter
    start: int
    end: int


class HostLoraPath:
    """The host-computed share of one step's LoRA work: runs of rows, one adapter each."""

    def __init__(self, runs: list[HostRun], offsets: dict[str, tuple[int, ...]]) -> None:
        self.runs = runs
        self.offsets = offsets
        """Each group's slice offsets in its fused output (adapters.layout.slice_offsets)."""

    @property
    def num_tokens(self) -> int:
        return sum(r.end - r.start for r in self.runs)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the group's deltas of every run's rows to `y` (x: [T, H_in], y: [T, N_total])."""
        offsets = self.offsets[group]
        for run in self.runs:
            rows = x[run.start : run.end].to("cpu", torch.float32)
            for index, proj in enumerate(GROUPS[group]):
                weights = run.adapter.modules.get((layer, proj))
                if weights is None:
                    continue
                # The slot would hold the weights in the model's dtype: round them the same way.
                a, b = (w.to(y.dtype).float() for w in (weights.a, weights.b))
                out = y[run.start : run.end, offsets[index] : offsets[index + 1]]
                delta = ((rows @ a.T) @ b.T).to(y.device)
                if weights.scale is None:
                    # A float32 operand: computed in float32, rounded once into y (as the kernels).
                    out += delta
                else:
                    scale = weights.scale.to(y.dtype).float().to(y.device)
                    out.copy_((out.float() + delta) * scale)
