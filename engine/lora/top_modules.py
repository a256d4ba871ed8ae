"""The token embedding's and the lm_head's adapter weights in one step: LoRA pairs added to the
embedding or the logits of an adapter's tokens, and saved copies (`modules_to_save`) used
instead of the base module's.

For a run of the step's token rows [start, end) whose adapter has such weights (from its pool
region, or from its host copy while the device copy runs), with ids the rows' token ids and
h the final hidden states of the rows that are sampled:

    embedding, LoRA    x[rows] += A.T[ids] @ B.T           (A [r, vocab], B [hidden, r])
    embedding, saved   x[rows]  = saved[ids]
    lm_head, LoRA      logits[rows] += (h @ A.T) @ B.T     (A [r, hidden], B [vocab, r])
    lm_head, saved     logits[rows]  = h @ saved.T

as PEFT computes them, in float32 with weights rounded to the model's dtype (as the pool holds
them) and one rounding into x. The embedding's work runs inside the forward pass, which a CUDA
graph does not capture: such steps run eagerly (engine.lora.batch.needs_eager). The lm_head's
runs after the forward pass, graphs or not. Only steps with such adapters pay anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.adapters.layout import TopWeights


@dataclass(frozen=True)
class TopRun:
    """Token rows [start, end) of the step use an adapter with embedding or lm_head weights."""

    weights: TopWeights
    start: int
    end: int


def _as(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` rounded to `like`'s dtype (as the pool holds it), as float32 on its device."""
    return tensor.to(like.device, like.dtype).float()


def apply_embedding(runs: list[TopRun], input_ids: torch.Tensor, x: torch.Tensor) -> None:
    """x: the embeddings [T, hidden] of input_ids [T], changed in place."""
    for run in runs:
        ids = input_ids[run.start : run.end]
        rows = x[run.start : run.end]
        saved = run.weights.saved.get("embed_tokens")
        if saved is not None:
            rows.copy_(saved.to(x.device)[ids])
        lora = run.weights.top.get("embed_tokens")
        if lora is not None:
            rows += _as(lora.a, x)[:, ids].T @ _as(lora.b, x).T


def apply_logits(
    runs: list[TopRun], logits_indices: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor
) -> None:
    """hidden: [N, hidden] the sampled rows' final hidden states, logits_indices [N] their token
    rows; logits [N, vocab] float32, changed in place."""
    for run in runs:
        if "lm_head" not in run.weights.top and "lm_head" not in run.weights.saved:
            continue
        mine = (logits_indices >= run.start) & (logits_indices < run.end)
        rows = mine.nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        h = hidden[rows]
        saved = run.weights.saved.get("lm_head")
        if saved is not None:
            logits[rows] = (h @ saved.to(h.device, h.dtype).T).float()
        lora = run.weights.top.get("lm_head")
        if lora is not None:
            logits[rows] += (h.float() @ _as(lora.a, h).T) @ _as(lora.b, h).T
