"""DoRA (weight-decomposed LoRA) as served: a per-output-channel scale on the adapted output.

PEFT's DoRA layer computes, for a base weight W [out, in] with no bias, the LoRA pair and its
magnitude vector m [out]:

    W' = m * (W + s B A) / ||W + s B A||_row          (norm of each output row, over inputs)
    y  = x W'.T = c * (x W.T + s x A.T B.T),  c = m / ||W + s B A||_row

The norm is treated as a constant at inference (PEFT detaches it), so c depends on the weights
only: it is computed once, at load, here. Serving then adds the LoRA delta as for plain LoRA and
multiplies the adapted tokens' slice of the output by c (the expand kernels' epilogue).
"""

from __future__ import annotations

import torch

_ROWS_PER_CHUNK = 1024
"""Rows of W + b @ a formed at once: bounds the temporary to 1024 * in_features floats."""


@torch.no_grad()
def dora_scale(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor
) -> torch.Tensor:
    """c = magnitude / ||weight + b @ a||_row as float32 [out] on the host (`b` has the scaling
    folded in; `weight` [out, in] may be in any dtype on any device, and is computed in float32
    there). A row whose merged norm is zero gives an infinite or NaN scale: the caller refuses it."""
    device = weight.device
    a32 = a.to(device, torch.float32)
    norms = torch.empty(weight.shape[0], dtype=torch.float32, device=device)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        end = start + _ROWS_PER_CHUNK
        merged = weight[start:end].float() + b[start:end].to(device, torch.float32) @ a32
        norms[start:end] = torch.linalg.vector_norm(merged, dim=1)
    return magnitude.to(torch.float32) / norms.cpu()
