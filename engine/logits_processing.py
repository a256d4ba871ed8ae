"""Per-request logits processors, applied to the whole step's logits on the device before
sampling: repetition penalty, presence and frequency penalties, logit bias.

    logits[r, t] → repetition (t in prompt or generated: / p when > 0, * p when < 0)
                 → - presence[r] * (count[r, t] > 0) - frequency[r] * count[r, t]
                 → + bias[r, t]

`count[r, t]` counts t among the tokens row r's sequence generated so far (the prompt does not
count, OpenAI's definition); the repetition penalty looks at prompt and generated tokens alike
(transformers' RepetitionPenaltyLogitsProcessor). The processed logits are what the sampler
draws from (after temperature and the truncations) and what logprobs are reported of.

A step whose rows use no processor builds nothing and pays nothing; one that does builds, for
its P penalized rows only, a [P, vocab] count matrix from the host's token lists with one
scatter-add (plus, under asynchronous scheduling, each row's token still on the device, read
from the previous step's sampled ids). Rebuilt every step: O(tokens so far) host work per
penalized row, simple and always consistent with preemption and forks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loramux.engine.scheduler import ScheduledChunk

PENALTY_RANGE = (2.0**-60, 2.0**60)
"""The repetition penalty is clamped into this range on the device: a larger one already sends
a penalized token's logit to the bottom (a logit of 1e4 becomes ~1e-14 or ~-1e22), while a
float32 penalty of 0 or infinity would turn logits into NaN or infinity."""


@dataclass(frozen=True)
class LogitsProcessors:
    """The processors of one step's penalized and biased rows (device tensors)."""

    penalty_rows: torch.Tensor
    """int64 [P]: sampling rows with some penalty."""
    presence: torch.Tensor
    """float32 [P]."""
    frequency: torch.Tensor
    """float32 [P]."""
    repetition: torch.Tensor
    """float32 [P], 1 where off."""
    counts: torch.Tensor
    """float32 [P, vocab]: each token's count among the row's generated tokens."""
    seen: torch.Tensor | None
    """bool [P, vocab]: the token occurs in the row's prompt or generated tokens; None when no
    row has a repetition penalty."""
    bias: torch.Tensor | None
    """float32 [rows, vocab] of logit biases; None when no row has any."""


def build_processors(
    rows: list[ScheduledChunk],
    vocab: int,
    device: torch.device,
    pending: dict[int, torch.Tensor] | None = None,
) -> LogitsProcessors | None:
    """The processors of the step whose sampling row i samples after `rows[i]`; None when no
    row uses any. `pending[i]`: a 0-d device tensor holding row i's last token, when that token
    has not landed in its sequence's `token_ids` yet (asynchronous scheduling)."""
    params = [c.seq.params for c in rows]
    penalized = [i for i, p in enumerate(params) if p.penalizes]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not penalized and not biased:
        return None
    bias = _bias(rows, biased, vocab, device) if biased else None
    repetition = any(params[i].repetition_penalty != 1.0 for i in penalized)
    counts, seen = _counts(rows, penalized, vocab, device, repetition, pending or {})
    low, high = PENALTY_RANGE
    floats = torch.tensor(
        [
            (p.presence_penalty, p.frequency_penalty, min(max(p.repetition_penalty, low), high))
            for p in (params[i] for i in penalized)
        ],
        dtype=torch.float32,
    ).reshape(-1, 3)
    floats = floats.to(device)
    return LogitsProcessors(
        penalty_rows=torch.tensor(penalized, dtype=torch.int64).to(device),
        presence=floats[:, 0],
        frequency=floats[:, 1],
        repetition=floats[:, 2],
        counts=counts,
        seen=seen,
        bias=bias,
    )


def _bias(
    rows: list[ScheduledChunk], biased: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    row_ids, token_ids, values = [], [], []
    for i in biased:
        for token, value in rows[i].seq.params.logit_bias:
            row_ids.append(i)
            token_ids.append(token)
            values.append(value)
    bias = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    index = (torch.tensor(row_ids).to(device), torch.tensor(token_ids).to(device))
    # A row's ids are distinct (SamplingParams refuses repeats): each bias stays in its bound.
    bias.index_put_(index, torch.tensor(values, dtype=torch.float32).to(device))
    return bias


def _counts(
    rows: list[ScheduledChunk],
    penalized: list[int],
    vocab: int,
    device: torch.device,
    repetition: bool,
    pending: dict[int, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[P, vocab] counts of generated tokens and (with a repetition penalty) seen tokens."""
    generated: list[np.ndarray] = []
    every: list[np.ndarray] = []
    for i in penalized:
        seq, end = rows[i].seq, rows[i].end
        landed = seq.token_ids[: min(end, len(seq.token_ids))]
        generated.append(np.asarray(landed[seq.num_prompt_tokens :], dtype=np.int64))
        every.append(np.asarray(landed, dtype=np.int64))
    counts = _scatter_counts(generated, vocab, device)
    seen = _scatter_counts(every, vocab, device) if repetition else None
    for p, i in enumerate(penalized):
        token = pending.get(i)
        if token is not None:  # its last token, still on the device, is a generated one
            counts[p, token] += 1
            if seen is not None:
                seen[p, token] += 1
    return counts, None if seen is None else seen > 0


def _scatter_counts(tokens: list[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    lengths = np.asarray([len(t) for t in tokens], dtype=np.int64)
    row_ids = torch.from_numpy(np.repeat(np.arange(len(tokens)), lengths)).to(device)
    flat = torch.from_numpy(np.concatenate(tokens) if tokens else np.zeros(0, np.int64))
    counts = torch.zeros(len(tokens), vocab, dtype=torch.float32, device=device)
    ones = torch.ones(flat.shape[0], dtype=torch.float32, device=device)
    counts.index_put_((row_ids, flat.to(device)), ones, accumulate=True)
    return counts


def apply_processors(logits: torch.Tensor, processors: LogitsProcessors) -> torch.Tensor:
    """The processed logits [rows, vocab] (a new tensor; `logits` is left as it was)."""
    out = logits.clone()
    if processors.penalty_rows.numel():
        rows = out[processors.penalty_rows]
        if processors.seen is not None:
            p = processors.repetition[:, None]
            penalized = torch.where(rows > 0, rows / p, rows * p)
            rows = torch.where(processors.seen, penalized, rows)
        rows = rows - processors.presence[:, None] * (processors.counts > 0)
        rows = rows - processors.frequency[:, None] * processors.counts
        out[processors.penalty_rows] = rows
    if processors.bias is not None:
        out += processors.bias
    return out
