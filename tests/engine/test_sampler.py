"""Sampling on the device for the whole batch: each row exactly as if it were sampled alone,
seeded rows independent of everything but their seed and position."""

from __future__ import annotations

import math

import pytest
import torch

from loramux.engine.sampler import (
    NO_TOKEN,
    SamplingBuffers,
    sample,
    sample_step,
    seeded_exponential,
)
from loramux.engine.sampling import SamplingParams
from loramux.engine.scheduler import ScheduledChunk
from loramux.engine.sequence import Sequence
from loramux.engine.structured.mask import TokenMask

VOCAB = 257
CPU = torch.device("cpu")


def _row(params: SamplingParams, position: int = 10) -> ScheduledChunk:
    """A chunk whose last position is `position - 1`: it samples the token at `position`."""
    seq = Sequence("r", list(range(position)), params)
    return ScheduledChunk(seq, position - 1, 1, True)


def _sample(logits: torch.Tensor, rows: list[ScheduledChunk]) -> list[int]:
    buffers = SamplingBuffers(len(rows), logits.device)
    return sample(logits, buffers.fill(rows, logits.shape[1])).tolist()


def _reference(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One row, step by step as the sampler's docstring says."""
    if not torch.isfinite(logits).all():
        return NO_TOKEN
    if params.greedy:
        return int(logits.argmax())
    x = (logits - logits.max()) / params.temperature
    ordered, order = x.sort(descending=True)
    if 0 < params.top_k < x.numel():
        ordered = ordered.masked_fill(ordered < ordered[params.top_k - 1], float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(ordered, dim=0)
        drop = probs.cumsum(0) - probs >= params.top_p
        drop[0] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    x = torch.empty_like(x).scatter_(0, order, ordered)
    seed = params.seed_bits or 0
    seeds = torch.tensor([[seed & 0xFFFFFFFF, seed >> 32]])
    noise = seeded_exponential(seeds, torch.tensor([position]), x.numel())[0]
    return int((torch.softmax(x, dim=0) / noise).argmax())


def _mixed_rows() -> list[tuple[SamplingParams, int]]:
    return [
        (SamplingParams(), 5),
        (SamplingParams(temperature=0.7, seed=1), 5),
        (SamplingParams(temperature=1.3, top_k=20, seed=2**63 + 11), 99),
        (SamplingParams(temperature=0.9, top_p=0.8, seed=-4), 7),
        (SamplingParams(temperature=1.0, top_k=5, top_p=0.5, seed=3), 123),
        (SamplingParams(), 8),
        (SamplingParams(temperature=2.0, top_k=10**30, top_p=1e-300, seed=9), 40),
        (SamplingParams(temperature=1e300, seed=17), 41),
        (SamplingParams(temperature=0.5, seed=1), 6),
    ]


def test_a_batch_samples_each_row_as_the_per_row_reference_does() -> None:
    rows = _mixed_rows()
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits[5, 17] = float("nan")
    got = _sample(logits, [_row(p, pos) for p, pos in rows])
    assert got == [_reference(logits[i], p, pos) for i, (p, pos) in enumerate(rows)]
    assert got[5] == NO_TOKEN and all(0 <= t < VOCAB for i, t in enumerate(got) if i != 5)


def test_a_seeded_row_draws_the_same_token_alone_and_in_any_batch() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(1))
    alone = _sample(logits[3:4], [_row(params, 50)])
    neighbours = [_row(SamplingParams(temperature=1.0), 50) for _ in range(12)]
    neighbours[3] = _row(params, 50)
    assert _sample(logits, neighbours)[3] == alone[0]


def test_seeded_draws_follow_the_probabilities() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    rows = [_row(SamplingParams(temperature=1.0, seed=7), pos) for pos in range(1, 4001)]
    logits = probs.log().expand(len(rows), 4).contiguous()
    counts = torch.bincount(torch.tensor(_sample(logits, rows)), minlength=4)
    for count, p in zip(counts.tolist(), probs.tolist(), strict=True):
        sigma = math.sqrt(len(rows) * p * (1 - p))
        assert abs(count - len(rows) * p) < 4 * sigma


def test_seeded_exponential_is_a_pure_function_of_seed_and_position() -> None:
    seeds = torch.tensor([[1, 0], [1, 0], [2, 0], [1, 1]])
    draws = seeded_exponential(seeds, torch.tensor([3, 4, 3, 3]), 4096)
    again = seeded_exponential(seeds[[2, 0]], torch.tensor([3, 3]), 4096)
    assert torch.equal(again, draws[[2, 0]])
    assert bool((draws > 0).all()) and bool(torch.isfinite(draws).all())
    assert len({tuple(row.tolist()) for row in draws}) == 4, "seed and position both matter"
    assert abs(float(draws.mean()) - 1.0) < 0.05, "Exp(1) has mean 1"


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-9}], ids=["top_k_1", "tiny_top_p"])
def test_keeping_one_token_gives_the_argmax_seeded_or_not(params: dict[str, float]) -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    rows = [
        _row(SamplingParams(temperature=1.5, seed=s, **params)) for s in (None, 3, None, 4, 5, None)
    ]
    assert _sample(logits, rows) == logits.argmax(dim=-1).tolist()


def test_a_constrained_rows_logprobs_are_of_the_masked_distribution_and_list_no_masked_token() -> (
    None
):
    """A row whose grammar allows tokens 3 and 7 samples one of them, and its logprobs are the
    log-softmax over those two (what it was drawn from): its top 5 lists just those two, their
    probabilities summing to 1. A free row beside it lists its 5 best of the whole vocabulary.
    The bug: masked tokens (-inf) filled the constrained row's top list."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(logprobs=True, top_logprobs=5)
    batch = SamplingBuffers(2, CPU).fill([_row(params), _row(params)], VOCAB)
    words = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    words[0, 0] = (1 << 3) | (1 << 7)
    expected = torch.log_softmax(logits, dim=-1)
    sampled = sample_step(logits.clone(), batch, TokenMask(words, torch.tensor([0])))
    constrained, free = sampled.logprob(0, 5), sampled.logprob(1, 5)
    allowed = torch.log_softmax(logits[0, [3, 7]], dim=0).tolist()
    assert dict(constrained.top) == pytest.approx(dict(zip([3, 7], allowed, strict=True)))
    assert math.isclose(sum(math.exp(p) for _, p in constrained.top), 1.0, rel_tol=1e-5)
    assert sampled.tolist()[0] == (3 if allowed[0] > allowed[1] else 7)
    assert constrained.logprob == pytest.approx(max(allowed))
    top = expected[1].topk(5)
    assert free.top == list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


def test_an_all_greedy_batch_is_its_argmax_and_flags_non_finite_rows() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[1] = float("inf")
    logits[2, 0] = float("-inf")
    expected = logits.argmax(dim=-1).tolist()
    expected[1] = expected[2] = NO_TOKEN
    assert _sample(logits, [_row(SamplingParams()) for _ in range(4)]) == expected


@pytest.mark.gpu
def test_seeded_and_greedy_rows_sample_the_same_tokens_on_cuda_as_on_the_cpu() -> None:
    rows = _mixed_rows()
    logits = torch.randn(len(rows), 32000, generator=torch.Generator().manual_seed(4)) * 3
    chunks = [_row(p, pos) for p, pos in rows]
    assert _sample(logits.cuda(), chunks) == _sample(logits, chunks)
