"""The grammar's token mask for a whole step: filled on the host for every constrained row at
once, applied on the device to the logits before sampling.

Order in a step (`LLMEngine._launch`): the model's forward pass is queued first, then the host
fills the masks (llguidance's parallel fill, which releases the GIL), then one copy moves them to
the device and they are applied. On CUDA the fill thus runs while the device computes the
forward pass; on the CPU the two run one after the other. Rows without a grammar pay nothing,
and a step with no constrained row neither fills nor copies anything.

Buffers, allocated once: `words` int32 [max_rows, W] with W = ceil(vocab / 32) on the host
(pinned on CUDA) and its device twin, and `rows` int64 [max_rows]. A step with k constrained
rows fills and copies k rows of each: for a 128k vocabulary and k = 32, 32 × 16 KiB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import llguidance
import llguidance.torch
import torch

from loramux.engine.scheduler import ScheduledChunk, sample_rows


@dataclass(frozen=True)
class TokenMask:
    """Which tokens k rows of a step's logits may sample. Device tensors, valid until the
    next `GrammarBitmask.fill`."""

    words: torch.Tensor
    """int32 [k, W]: bit b of word w allows token 32 w + b."""
    rows: torch.Tensor
    """int64 [k]: the logits row each mask row applies to."""

    def apply_(self, logits: torch.Tensor) -> None:
        apply_token_mask_(logits, self.words, self.rows)


def apply_token_mask_(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """Disallowed tokens' logits become -inf, in place.

    Semantics:
        for i in range(k), v in range(vocab):
            if not (words[i, v // 32] >> (v % 32)) & 1:  logits[rows[i], v] = -inf
    logits: float [N, vocab]; words: int32 [k, W] with 32 W >= vocab; rows: int64 [k], distinct.
    Bits past the vocabulary are ignored.
    """
    vocab = logits.shape[1]
    # The model's logits are inference tensors: only inference mode may update them in place.
    with torch.inference_mode():
        shifts = torch.arange(32, device=words.device, dtype=torch.int32)
        allowed = ((words[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


class GrammarBitmask:
    """Preallocated mask buffers of one engine and the thread pool that fills them."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        on_cuda = device.type == "cuda"
        words = llguidance.torch.get_bitmask_shape(max_rows, vocab_size)[1]
        self._words = torch.zeros(max_rows, words, dtype=torch.int32, pin_memory=on_cuda)
        self._rows = torch.zeros(max_rows, dtype=torch.int64, pin_memory=on_cuda)
        self._words_dev = self._words.to(device) if on_cuda else self._words
        self._rows_dev = self._rows.to(device) if on_cuda else self._rows
        self._executor = llguidance.LLExecutor(min(8, os.cpu_count() or 1))
        self._copied = torch.cuda.Event() if on_cuda else None

    @staticmethod
    def waits_for_landing(chunks: list[ScheduledChunk]) -> bool:
        """Some constrained chunk samples after a token that has not landed yet (asynchronous
        scheduling): its mask depends on that token, so the step that samples it must land
        first."""
        return any(
            c.samples and c.seq.grammar is not None and len(c.seq.token_ids) < c.end for c in chunks
        )

    def fill(self, chunks: list[ScheduledChunk]) -> TokenMask | None:
        """The masks of the step's sampling rows that have a grammar; None when none has.
        Rows are numbered as the sampler's (`sample_rows` of `chunks` in run order: a chunk
        that forks choices samples one row for each, right after its own), and each row is
        masked by its own sequence's matcher, so every choice follows its own grammar state.
        Sequences finished meanwhile (aborted, or ended by the step that just landed) are left
        unconstrained: their token is dropped."""
        constrained = [
            (row, c.seq.grammar)
            for row, c in enumerate(sample_rows(chunks))
            if c.seq.grammar is not None and not c.seq.is_finished
        ]
        if not constrained:
            return None
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host buffers
        k = len(constrained)
        self._rows.numpy()[:k] = [row for row, _ in constrained]
        targets = [(grammar.ll, i) for i, (_, grammar) in enumerate(constrained)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, targets, self._words[:k])
        if self._words_dev is not self._words:
            self._words_dev[:k].copy_(self._words[:k], non_blocking=True)
            self._rows_dev[:k].copy_(self._rows[:k], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return TokenMask(self._words_dev[:k], self._rows_dev[:k])
