"""One adapted module's weights as loramux holds them (float32, scaling folded in)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraWeights:
    """One adapted module: delta_W = b @ a, scaling already folded into `b`.

    Both are float32, whatever the file's dtype (float16 and bfloat16 convert exactly, and
    the fold then rounds once in float32); the engine casts to its own dtype when it copies
    them into a device slot.
    """

    a: torch.Tensor
    """[rank, in_features] float32 (the embedding's: [rank, vocab])."""
    b: torch.Tensor
    """[out_features, rank] float32, equal to the file's lora_B times the adapter's scaling."""
    scale: torch.Tensor | None = None
    """DoRA only: [out_features] float32, the output's per-channel scale (adapters.dora). None
    for plain LoRA, and for a DoRA adapter loaded without the base weights (validation only)."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """A, B and (DoRA) the scale, in the order they are laid out in memory."""
        return (self.a, self.b) if self.scale is None else (self.a, self.b, self.scale)
