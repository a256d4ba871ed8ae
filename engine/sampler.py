"""Token selection on the device for the whole batch at once: logits processors, greedy,
temperature, top-k, top-p, min-p, per-request seeds and logprobs, in tensor operations.

One row per sequence that samples. First the logits processors (penalties and logit bias,
`engine.logits_processing`) make the *processed* logits. A greedy row takes their argmax. A
random row is shifted so its largest logit is 0 and divided by its temperature; top-k keeps the
logits at or above the k-th largest, then top-p keeps the smallest prefix of the sorted
probabilities whose mass reaches top_p (the token crossing it included; never less than the top
token), then min-p drops the tokens less likely than min_p times the top one. The token is
drawn by the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) independent per vocabulary
entry picks token i with probability p_i.

Logprobs are the log-softmax of the processed logits: after penalties and bias, before
temperature and the truncations (top-k, top-p, min-p), as OpenAI and vLLM report them. For a
request with no processor they are the log-softmax of the model's logits. A constrained row's
are taken after its grammar's mask (`sample_step` says why), and the tokens the mask forbids
are left out of its top logprobs.

Seeds. A seeded row draws its E from a counter-based hash of (seed mod 2^64, the position it
samples, the vocabulary index) — see `seeded_exponential` — so its token depends on its seed,
its position and its own logits only: never on other rows, the batch size, the step, or any
generator's state. A given seed gives the same output for as long as `seeded_exponential` and
the model are unchanged; changing that function changes every seeded output and must be
announced. Unseeded rows draw E from torch's generator on the device.

The host reads back one int64 per row, once per step: the token id, or NO_TOKEN for a row
whose logits are not all finite (no token can be drawn from it: that request alone fails). In a
step where some row asks for logprobs the one readback is a float64 [rows, 2 + 2K] instead:
(token id, its logprob, K top ids, K top logprobs), K the most top_logprobs any row asked for
(ids below 2^53 and float32 logprobs are exact in float64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loramux.engine.logits_processing import LogitsProcessors, apply_processors, build_processors
from loramux.engine.outputs import TokenLogprob
from loramux.engine.scheduler import ScheduledChunk
from loramux.engine.structured.mask import TokenMask

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
    min_p: torch.Tensor
    """float32 [R] in [0, 1]; 0 keeps everything."""
    filters: bool
    """Some random row keeps fewer than all tokens (top_k < vocab, top_p < 1 or min_p > 0)."""
    processors: LogitsProcessors | None = None
    """Penalties and biases of the rows that have any; None when no row does."""
    top_logprobs: int | None = None
    """None: no row asks for logprobs; else the most top logprobs any row asks for."""

    @property
    def num_random(self) -> int:
        return self.random_rows.shape[0]

    @property
    def num_seeded(self) -> int:
        return self.seeds.shape[0]


class SamplingBuffers:
    """Preallocated staging for `SamplingBatch`: [max_rows, 3] float32 (temperature, top_p,
    min_p) and [max_rows, 5] int64 (row, top_k, seed low and high, position) on the host,
    pinned on CUDA, and their device twins; a step with R random rows copies R rows of each
    (64 rows: 768 B + 2.5 KiB). An all-greedy step copies nothing. Logits processors are built
    only for steps where some row has one (`engine.logits_processing`)."""

    def __init__(self, max_rows: int, device: torch.device):
        on_cuda = device.type == "cuda"
        self._floats = torch.zeros(max_rows, 3, dtype=torch.float32, pin_memory=on_cuda)
        self._ints = torch.zeros(max_rows, 5, dtype=torch.int64, pin_memory=on_cuda)
        self._floats_dev = self._floats.to(device) if on_cuda else self._floats
        self._ints_dev = self._ints.to(device) if on_cuda else self._ints
        self.device = device

    def fill(
        self,
        rows: list[ScheduledChunk],
        vocab: int,
        pending: dict[int, torch.Tensor] | None = None,
    ) -> SamplingBatch:
        """The batch whose row i samples the token after chunk `rows[i]` (`pending`: see
        `build_processors`). Parameters are clamped into the ranges the arithmetic supports
        (top_k past the vocabulary keeps all, a temperature past float32's range is its
        largest)."""
        params = [c.seq.params for c in rows]
        random = [i for i, p in enumerate(params) if not p.greedy]
        seeded = [i for i in random if params[i].seed_bits is not None]
        order = seeded + [i for i in random if params[i].seed_bits is None]
        floats, ints = self._floats.numpy(), self._ints.numpy()
        filters = False
        for r, i in enumerate(order):
            p = params[i]
            top_k = vocab if p.top_k == 0 else min(p.top_k, vocab)
            filters |= top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0
            floats[r] = (min(p.temperature, FLOAT32_MAX), p.top_p, p.min_p)
            seed = p.seed_bits or 0
            ints[r] = (i, top_k, seed & _MASK32, seed >> 32, rows[i].end)
        n = len(order)
        if self._floats_dev is not self._floats:
            self._floats_dev[:n].copy_(self._floats[:n], non_blocking=True)
            self._ints_dev[:n].copy_(self._ints[:n], non_blocking=True)
        f, k = self._floats_dev[:n], self._ints_dev[:n]
        s = len(seeded)
        wants_logprobs = [p.top_logprobs for p in params if p.logprobs]
        return SamplingBatch(
            num_rows=len(rows),
            random_rows=k[:, 0],
            temperature=f[:, 0],
            top_p=f[:, 1],
            top_k=k[:, 1],
            seeds=k[:s, 2:4],
            positions=k[:s, 4],
            min_p=f[:, 2],
            filters=filters,
            processors=build_processors(rows, vocab, self.device, pending),
            top_logprobs=max(wants_logprobs) if wants_logprobs else None,
        )


class SampledTokens:
    """One step's sampled ids (`sample_step`'s result): on the device, where the next step's
    pending inputs read them, and on their way to the host, which reads them once (with the
    logprobs, when some row asked for them)."""

    def __init__(self, ids: torch.Tensor, logprobs: torch.Tensor | None = None):
        self.ids = ids
        self._copied: torch.cuda.Event | None = None
        readback = ids if logprobs is None else torch.cat([ids[:, None].double(), logprobs], 1)
        self._host = readback
        if ids.is_cuda:
            self._host = torch.empty(readback.shape, dtype=readback.dtype, pin_memory=True)
            self._host.copy_(readback, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._rows: list[Any] | None = None

    def _landed(self) -> list[Any]:
        if self._rows is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._rows = self._host.tolist()
        return self._rows

    def tolist(self) -> list[int | None]:
        """Each row's token, None where the logits were not finite; waits for the device."""
        rows = self._landed()
        tokens = rows if self._host.dim() == 1 else [int(r[0]) for r in rows]
        return [None if t == NO_TOKEN else t for t in tokens]

    def logprob(self, row: int, top: int) -> TokenLogprob:
        """Row `row`'s token logprob and its `top` most likely alternatives (the step must have
        computed logprobs, for at least `top` alternatives). Alternatives of logprob -inf
        (forbidden by a grammar's mask, so never drawn) are left out: a constrained row may
        list fewer than `top`."""
        values = self._landed()[row]
        k = (len(values) - 2) // 2
        assert top <= k, "the step computed fewer top logprobs than asked"
        pairs = [(int(values[2 + j]), values[2 + k + j]) for j in range(top)]
        return TokenLogprob(values[1], [(t, p) for t, p in pairs if p != float("-inf")])


def sample_step(
    logits: torch.Tensor, batch: SamplingBatch, grammar: TokenMask | None = None
) -> SampledTokens:
    """Process the logits, mask the constrained rows, sample every row and compute logprobs
    where asked: the step's whole device work after the model, queued. Logprobs are of the
    processed logits after the grammar's mask: the distribution the token was drawn from, so
    that the token's logprob and its alternatives' are one distribution's (a token the grammar
    forced has logprob 0). Where the grammar allows fewer than k tokens, masked ones (-inf)
    fill the end of a row's top k on the device; `SampledTokens.logprob` drops them."""
    if batch.processors is not None:
        logits = apply_processors(logits, batch.processors)
    ids = sample(logits, batch, grammar)
    if batch.top_logprobs is None:
        return SampledTokens(ids)
    return SampledTokens(ids, token_logprobs(logits, ids, batch.top_logprobs))


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """float64 [N, 1 + 2k]: each row's log-softmax at its token (NO_TOKEN rows: any value),
    then the ids and log-softmax values of its k most likely tokens, best first."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, ids.clamp_min(0)[:, None])
    if k == 0:
        return chosen.double()
    top = logprobs.topk(k, dim=-1)
    return torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, grammar: TokenMask | None = None
) -> torch.Tensor:
    """float32 (processed) logits [N, vocab] → int64 [N] on the same device: each row's token, or NO_TOKEN
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
        x = min_p_filter(x, batch.min_p)
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


def min_p_filter(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x [R, V] (tempered logits) with the tokens whose probability is below min_p times the
    top token's set to -inf, per row: p_i < min_p * p_max  ⇔  x_i - x_max < log(min_p). The
    top token always stays; min_p 0 (log -inf) drops nothing."""
    floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return x.masked_fill(x < floor, float("-inf"))


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
