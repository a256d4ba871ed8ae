"""Token selection: greedy, or temperature / top-k / top-p sampling with per-request seeds.

Each seeded request draws its randomness from its own `torch.Generator`, so its output does not
depend on what else shares the batch. A row whose logits are not all finite (an adapter whose
weights overflow, say) has no token: that request alone fails, the other rows sample as usual.
"""

from __future__ import annotations

import torch

from engine.sampling import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | None]:
    """logits: float32 [N, vocab], one row per sampling sequence → one token id per row, or None
    for a row holding NaN or an infinity (no token can be drawn from it)."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[int | None] = []
    for i, p in enumerate(params):
        if not finite[i]:
            tokens.append(None)
        elif p.greedy:
            tokens.append(greedy[i])
        else:
            tokens.append(_sample_row(logits[i], p, generators[i]))
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits.float().cpu()
    # Shifted so the largest is 0 before dividing: finite logits then never overflow, whatever
    # their size, and every other logit scales to a finite negative number or -inf (weight 0).
    logits = (logits - logits.max()) / float(p.temperature)
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        # The most likely token always stays: a top_p that float32 rounds to 0 (1e-300) would
        # otherwise drop every token.
        drop = cumulative - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
