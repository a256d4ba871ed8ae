"""Token selection on the device for the whole batch at once: greedy, temperature, top-k,
top-p and per-request seeds, in tensor operations.

One row per sequence that samples. A greedy row takes its argmax. A random row is shifted so
its largest logit is 0 and divided by its temperature; top-k keeps the logits at or above the
k-th largest, then top-p keeps the smallest prefix of the sorted probabilities whose mass
reaches top_p (the token crossing it included; never less than the top token). The token is
drawn by the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) independent per vocabulary
entry picks token i with probability p_i.

Seeds. A seeded row draws its E from a counter-based hash of (seed mod 2^64, the position it
samples, the vocabulary index) — see `seeded_exponential` — so its token depends on its seed,
its position and its own logits only: never on other rows, the batch size, the step, or any
generator's state. A given seed gives the same output for as long as `seeded_exponential` and
the model are unchanged; changing that function changes every seeded output and must be
announced. Unseeded rows draw E from torch's generator on the device.

The host reads back one int64 per row, once per step: the token id, or NO_TOKEN for a row
whose logits are not all finite (no token can be drawn from it: that request alone fails).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler import ScheduledChunk
from engine.structured.mask import TokenMask

NO_TOKEN = -1
"""What `sample` returns for a row whose logits hold NaN or an infinity."""

FLOAT32_MAX = 3.4028234663852886e38
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step. Random rows are listed seeded first, so the
    first `num_seeded` entries of `random_rows` are the seeded rows, in the order of `seeds`.
    Tensors are device views into `SamplingBuffers`, valid until its next fill."""

    num_rows: int
    random_rows: torch.Tensor
    """int64 [R]: rows drawn at random (not greedy)."""
    temperature: torch.Tensor
    """float32 [R], > 0 (and at most float32's largest)."""
    top_p: torch.Tensor
    """float32 [R] in [0, 1]; 1 keeps everything."""
    top_k: torch.Tensor
    """int64 [R] in [1, vocab]; vocab keeps everything."""
    seeds: torch.Tensor
    """int64 [S, 2]: low and high 32 bits of each seeded row's seed mod 2^64."""
    positions: torch.Tensor
    """int64 [S]: the position each seeded row samples (the tokens before it)."""
    filters: bool
    """Some random row keeps fewer than all tokens (top_k < vocab or top_p < 1)."""

    @property
    def num_random(self) -> int:
        return self.random_rows.shape[0]

    @property
    def num_seeded(self) -> int:
        return self.seeds.shape[0]


class SamplingBuffers:
    """Preallocated staging for `SamplingBatch`: [max_rows, 2] float32 (temperature, top_p)
    and [max_rows, 5] int64 (row, top_k, seed low and high, position) on the host, pinned on
    CUDA, and their device twins; a step with R random rows copies R rows of each (64 rows:
    512 B + 2.5 KiB). An all-greedy step copies nothing."""

    def __init__(self, max_rows: int, device: torch.device):
        on_cuda = device.type == "cuda"
        self._floats = torch.zeros(max_rows, 2, dtype=torch.float32, pin_memory=on_cuda)
        self._ints = torch.zeros(max_rows, 5, dtype=torch.int64, pin_memory=on_cuda)
        self._floats_dev = self._floats.to(device) if on_cuda else self._floats
        self._ints_dev = self._ints.to(device) if on_cuda else self._ints

    def fill(self, rows: list[ScheduledChunk], vocab: int) -> SamplingBatch:
        """The batch whose row i samples the token after chunk `rows[i]`. Parameters are
        clamped into the ranges the arithmetic supports (top_k past the vocabulary keeps all,
        a temperature past float32's range is its largest)."""
        params = [c.seq.params for c in rows]
        random = [i for i, p in enumerate(params) if not p.greedy]
        seeded = [i for i in random if params[i].seed_bits is not None]
        order = seeded + [i for i in random if params[i].seed_bits is None]
        floats, ints = self._floats.numpy(), self._ints.numpy()
        filters = False
        for r, i in enumerate(order):
            p = params[i]
            top_k = vocab if p.top_k == 0 else min(p.top_k, vocab)
            filters |= top_k < vocab or p.top_p < 1.0
            floats[r] = (min(p.temperature, FLOAT32_MAX), p.top_p)
            seed = p.seed_bits or 0
            ints[r] = (i, top_k, seed & _MASK32, seed >> 32, rows[i].end)
        n = len(order)
        if self._floats_dev is not self._floats:
            self._floats_dev[:n].copy_(self._floats[:n], non_blocking=True)
            self._ints_dev[:n].copy_(self._ints[:n], non_blocking=True)
        f, k = self._floats_dev[:n], self._ints_dev[:n]
        s = len(seeded)
        return SamplingBatch(
            num_rows=len(rows),
            random_rows=k[:, 0],
            temperature=f[:, 0],
            top_p=f[:, 1],
            top_k=k[:, 1],
            seeds=k[:s, 2:4],
            positions=k[:s, 4],
            filters=filters,
        )


class SampledTokens:
    """One step's sampled ids (`sample`'s result): on the device, where the next step's pending
    inputs read them, and on their way to the host, which reads them once."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self._copied: torch.cuda.Event | None = None
        self._host = ids
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def tolist(self) -> list[int | None]:
        """Each row's token, None where the logits were not finite; waits for the device."""
        if self._copied is not None:
            self._copied.synchronize()
        return [None if t == NO_TOKEN else t for t in self._host.tolist()]


def sample(
    logits: torch.Tensor, batch: SamplingBatch, grammar: TokenMask | None = None
) -> torch.Tensor:
    """float32 logits [N, vocab] → int64 [N] on the same device: each row's token, or NO_TOKEN
    where the row holds NaN or an infinity. `grammar` masks the constrained rows' disallowed
    tokens to -inf (in place) once the logits are known finite."""
    assert logits.shape[0] == batch.num_rows
    finite = torch.isfinite(logits).all(dim=-1)
    if grammar is not None:
        grammar.apply_(logits)
    tokens = logits.argmax(dim=-1)
    if batch.num_random:
        tokens[batch.random_rows] = _draw(logits[batch.random_rows], batch)
    return torch.where(finite, tokens, NO_TOKEN)


def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The random rows' tokens (see the module docstring for the arithmetic)."""
    # Shifted so the largest is 0 before dividing: finite logits then never overflow, whatever
    # their size, and every other logit scales to a finite negative number or -inf (weight 0).
    x = (logits - logits.max(dim=-1, keepdim=True).values) / batch.temperature[:, None]
    if batch.filters:
        x = _top_k_top_p(x, batch.top_k, batch.top_p)
    probs = torch.softmax(x, dim=-1)
    noise = torch.empty_like(probs)
    s = batch.num_seeded
    if s:
        noise[:s] = seeded_exponential(batch.seeds, batch.positions, probs.shape[1])
    if s < noise.shape[0]:
        noise[s:].exponential_()
    # A draw of exactly 0 would turn a dropped token's 0 / 0 into NaN, which argmax picks.
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [R, V] with the logits top-k and then top-p drop set to -inf (per row)."""
    ordered, order = x.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (top_k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, ordered)


def seeded_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [S, vocab] of Exp(1) draws, a pure function of each row's seed and position.

    Semantics (all integers taken mod 2^32; h is Wellons' `lowbias32` integer hash):
        key[r]    = h(h(h(positions[r] ^ 0x9E3779B9) ^ seeds[r, 1]) ^ seeds[r, 0])
        bits[r,v] = h(key[r] ^ h(v ^ 0x85EBCA6B))
        u[r,v]    = (bits[r,v] >> 8) / 2^24 + 2^-25              in (0, 1), 24 bits
        E[r,v]    = -log(u[r,v])
    seeds: int64 [S, 2] (low, high 32 bits of the seed); positions: int64 [S]. Computed in
    int64 tensor arithmetic that never overflows, so every device gives the same bits.
    """
    key = _hash32(positions ^ 0x9E3779B9)
    key = _hash32(key ^ seeds[:, 1])
    key = _hash32(key ^ seeds[:, 0])
    columns = _hash32(torch.arange(vocab, device=seeds.device) ^ 0x85EBCA6B)
    bits = _hash32(key[:, None] ^ columns[None, :])
    u = (bits >> 8).to(torch.float32) * 2.0**-24 + 2.0**-25
    return u.log_().neg_()


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), split in 16-bit halves of c so that no int64
    product passes 2^48."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32
