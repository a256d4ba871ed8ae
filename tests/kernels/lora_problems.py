"""The multi-LoRA kernels' test problems, and how a kernel is checked against its torch twin.

Cases cover dtype, hidden size, rank (uniform and mixed across slots), token count, how tokens
spread over adapters, and projection groups (L=3 with unequal widths, L=2, L=1, a slice of rank
0), sampled pairwise. The kernels read each slot's weights from a flat pool at offsets, packed
at the slot's own rank in shuffled order with NaN between regions; x rows of tokens without an
adapter and expand inputs beyond the rank hold NaN too, so any read of them shows in the result.
Odd slots are DoRA adapters: a per-column scale follows each of their B matrices in the pool,
and every expand runs once without the scale offsets and once with them (even slots' -1).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from loramux.kernels.lora_meta import INTERPRET, LoraBatchMeta, LoraMetaBuffers

KERNEL_DEVICE = torch.device("cpu" if INTERPRET else "cuda")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Relative tolerance per dtype (of the larger of 1 and |value|): kernels and twins round once
# into y's dtype (about 2 ulps apart at most); compiled, tl.dot runs fp32 as tf32 and expand
# rounds t to the weights' dtype first.
TOLERANCE = (
    {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}
    if INTERPRET
    else {"fp32": 5e-3, "fp16": 4e-3, "bf16": 3e-2}
)
GROUPS = {  # slice widths as multiples of hidden/4: q k v, gate up, o
    "qkv": (4, 1, 1),
    "qkv_v_off": (4, 1, 1),
    "gate_up": (8, 8),
    "o": (4,),
}
MIXED_RANKS = (8, 16, 32, 64)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@dataclass(frozen=True)
class Case:
    """One problem: ``rank`` is the rank of every slot, or "mixed" (per slot and slice, max 64);
    ``spread`` is how the tokens pick adapter slots; ``group`` names the slice layout."""

    dtype: str
    hidden: int
    rank: str
    tokens: int
    spread: str
    group: str

    def __str__(self) -> str:
        return f"{self.dtype}-h{self.hidden}-r{self.rank}-t{self.tokens}-{self.spread}-{self.group}"


DIMENSIONS = (
    tuple(DTYPES),
    (64, 200, 1024),
    ("8", "16", "64", "128", "mixed"),
    (1, 7, 64, 300),
    ("distinct", "uniform", "zipf", "one", "some_none"),
    tuple(GROUPS),
)


def _case(choice: tuple[int, ...]) -> Case:
    dtypes, hiddens, ranks, tokens, spreads, groups = DIMENSIONS
    d, h, r, t, s, g = choice
    return Case(dtypes[d], hiddens[h], ranks[r], tokens[t], spreads[s], groups[g])


def _affordable(case: Case) -> bool:
    """Interpreter cost bounds: all-distinct adapters need a slot (and a segment) per token;
    tokens x rank x (hidden + output width) bounds the gather work of the per-token kernels."""
    width = sum(GROUPS[case.group]) * case.hidden // 4
    max_rank = 64 if case.rank == "mixed" else int(case.rank)
    few_segments = case.spread != "distinct" or case.tokens <= 7
    return few_segments and case.tokens * max_rank * (case.hidden + width) <= 1 << 25


def pairwise(
    sizes: tuple[int, ...], allowed: Callable[[tuple[int, ...]], bool]
) -> list[tuple[int, ...]]:
    """Greedy all-pairs sampling of choices (one value index per dimension): every allowed pair
    of values of two dimensions appears in some choice; each round takes the allowed choice
    that covers most uncovered pairs."""

    def pairs(choice: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
        return {
            (a, choice[a], b, choice[b]) for a, b in itertools.combinations(range(len(sizes)), 2)
        }

    candidates = [c for c in itertools.product(*(range(n) for n in sizes)) if allowed(c)]
    uncovered = set().union(*(pairs(c) for c in candidates))
    chosen = []
    while uncovered:
        best = max(candidates, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


CASES = [
    _case(choice)
    for choice in pairwise(tuple(len(d) for d in DIMENSIONS), lambda c: _affordable(_case(c)))
]


@dataclass(frozen=True)
class Problem:
    """Stacked weights with NaN beyond each slot's rank (the per-token loop's view) and the same
    weights packed into a pool (the kernels' view, see `pack`), x with NaN in rows of tokens without
    an adapter, the token-to-slot assignment in segment order, and ``written``: the entries of
    t that a shrink writes (adapter tokens' rows, up to the slot's rank per slice)."""

    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    pool: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    scale_offsets: torch.Tensor
    """DoRA: where the odd slots' per-column scales lie in the pool; -1 elsewhere."""
    scales: torch.Tensor
    """[S, N] float64: every slot's per-column scale (used for odd slots only)."""
    ranks: torch.Tensor
    offsets: tuple[int, ...]
    token_slots: tuple[int | None, ...]
    y0: torch.Tensor
    written: torch.Tensor

    def to(self, device: torch.device) -> Problem:
        move = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return Problem(**{**vars(self), **move})

    def t_zeros(self) -> torch.Tensor:
        return torch.zeros(self.written.shape, device=self.x.device)


def _assignment(spread: str, tokens: int, rng: random.Random) -> tuple[int, list[int | None]]:
    """(number of slots, slot per token in segment order: runs of equal slots)."""
    num_slots, num_none = 8, max(1, tokens // 4) if spread == "some_none" else 0
    slots: list[int | None]
    if spread == "distinct":
        num_slots, slots = tokens, [*rng.sample(range(tokens), tokens)]
    elif spread == "one":
        num_slots, slots = 4, [2] * tokens
    elif spread == "zipf":
        zipf = [1 / (k + 1) ** 1.5 for k in range(num_slots)]
        slots = [*sorted(rng.choices(range(num_slots), weights=zipf, k=tokens))]
    else:
        slots = [*sorted(rng.choices(range(num_slots), k=tokens - num_none))]
    for _ in range(num_none):  # a few runs of base-model tokens between adapter runs
        slots.insert(rng.choice([0, len(slots) // 3, len(slots)]), None)
    return num_slots, slots


def pack(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor,
    offsets: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pool, a_offsets, b_offsets, scale_offsets): every slot's A [r, H] and B [width, r] per
    slice, at its own rank, then for odd (DoRA) slots the slice's scales [width]; slots in a
    shuffled order, each part followed by a few NaN elements."""
    gap = 5
    a_offsets = torch.zeros(ranks.shape, dtype=torch.int64)
    b_offsets = torch.zeros(ranks.shape, dtype=torch.int64)
    scale_offsets = torch.full(ranks.shape, -1 - gap, dtype=torch.int64)
    parts, used = [], 0
    nan = torch.full((gap,), math.nan)
    order = torch.randperm(ranks.shape[0], generator=torch.Generator().manual_seed(3))
    for slot in order.tolist():
        for j, r in enumerate(ranks[slot].tolist()):
            if not r:
                continue
            a = lora_a[slot, j, :r].flatten()
            b = lora_b[slot, offsets[j] : offsets[j + 1], :r].flatten()
            a_offsets[slot, j], b_offsets[slot, j] = used, used + a.numel() + gap
            parts += [a, nan, b, nan]
            used += a.numel() + b.numel() + 2 * gap
            if slot % 2:
                scale_offsets[slot, j] = used
                parts += [scales[slot, offsets[j] : offsets[j + 1]].float(), nan]
                used += offsets[j + 1] - offsets[j] + gap
    pool = torch.cat([nan, *parts]) if parts else torch.zeros(gap)
    return pool, a_offsets + gap, b_offsets + gap, scale_offsets + gap


@functools.cache
def make_problem(case: Case) -> Problem:
    seed = zlib.crc32(str(case).encode())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_slots, token_slots = _assignment(case.spread, case.tokens, rng)
    widths = [w * case.hidden // 4 for w in GROUPS[case.group]]
    offsets = (0, *itertools.accumulate(widths))
    max_rank = 64 if case.rank == "mixed" else int(case.rank)
    shape = (num_slots, len(widths))
    if case.rank == "mixed":
        ranks = torch.tensor(MIXED_RANKS)[torch.randint(0, len(MIXED_RANKS), shape, generator=gen)]
    else:
        ranks = torch.full(shape, max_rank)
    if case.group == "qkv_v_off":
        ranks[:, 2] = 0
    lora_a = torch.randn(num_slots, len(widths), max_rank, case.hidden, generator=gen) / math.sqrt(
        case.hidden
    )
    lora_b = torch.randn(num_slots, offsets[-1], max_rank, generator=gen) / math.sqrt(max_rank)
    rank_pos = torch.arange(max_rank)
    lora_a[rank_pos >= ranks[:, :, None]] = math.nan
    cols_rank = torch.cat([ranks[:, j : j + 1].expand(-1, w) for j, w in enumerate(widths)], dim=1)
    lora_b[rank_pos >= cols_rank[:, :, None]] = math.nan
    x = torch.randn(case.tokens, case.hidden, generator=gen)
    x[[i for i, s in enumerate(token_slots) if s is None]] = math.nan
    token_ranks = torch.stack(
        [ranks[s] if s is not None else torch.zeros_like(ranks[0]) for s in token_slots]
    )
    dtype = DTYPES[case.dtype]
    scales = (0.5 + torch.rand(num_slots, offsets[-1], generator=gen)).to(dtype).double()
    pool, a_offsets, b_offsets, scale_offsets = pack(lora_a, lora_b, scales, ranks, offsets)
    return Problem(
        x=x.to(dtype),
        lora_a=lora_a.to(dtype),
        lora_b=lora_b.to(dtype),
        pool=pool.to(dtype),
        a_offsets=a_offsets,
        b_offsets=b_offsets,
        scale_offsets=scale_offsets,
        scales=scales,
        ranks=ranks.to(torch.int32),
        offsets=offsets,
        token_slots=tuple(token_slots),
        y0=torch.randn(case.tokens, offsets[-1], generator=gen).to(dtype),
        written=rank_pos < token_ranks.T[:, :, None],
    )


@functools.cache
def per_token_loop(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 reference, one token and slice at a time: (t, NaN where not written; y; y with
    the odd slots' adapted slices scaled, as DoRA)."""
    p = make_problem(case)
    lora_a, lora_b, x = p.lora_a.double(), p.lora_b.double(), p.x.double()
    t = torch.full(p.written.shape, math.nan, dtype=torch.float64)
    y, y_dora = p.y0.double(), p.y0.double()
    ranks = p.ranks.tolist()
    for i, slot in enumerate(p.token_slots):
        for j, r in enumerate([] if slot is None else ranks[slot]):
            if not r:
                continue
            c0, c1 = p.offsets[j], p.offsets[j + 1]
            t[j, i, :r] = lora_a[slot, j, :r] @ x[i]
            y[i, c0:c1] += lora_b[slot, c0:c1, :r] @ t[j, i, :r]
            y_dora[i, c0:c1] = y[i, c0:c1] * (p.scales[slot, c0:c1] if slot % 2 else 1)
    return t, y, y_dora


def segments(p: Problem) -> tuple[torch.Tensor, ...]:
    meta = _build(p.token_slots, p.x.device)
    return meta.seg_starts, meta.seg_lens, meta.seg_slots


def per_token(p: Problem) -> tuple[torch.Tensor, ...]:
    """Per-token metadata listing the adapter tokens in a shuffled order."""
    meta = _build(p.token_slots, p.x.device)
    order = torch.randperm(meta.num_adapter_tokens, generator=torch.Generator().manual_seed(7))
    order = order.to(p.x.device)
    return meta.token_indices[order], meta.token_slots[order]


def _build(token_slots: tuple[int | None, ...], device: torch.device) -> LoraBatchMeta:
    return LoraMetaBuffers(max(len(token_slots), 1), device).build(token_slots)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: str) -> None:
    """Equal within the dtype's tolerance relative to max(1, |expected|); NaN where expected."""
    expected = expected.to(actual.device)
    tol = TOLERANCE[dtype] * expected.abs().clamp(min=1).nan_to_num(nan=1)
    both_nan = actual.isnan() & expected.isnan()
    close = ((actual.double() - expected.double()).abs() <= tol) | both_nan
    assert bool(close.all()), f"{int((~close).sum())} of {close.numel()} differ"


Op = Callable[..., None]
Layout = Callable[[Problem], tuple[torch.Tensor, ...]]


def check_shrink(
    case: Case, p: Problem, kernel: Op, twin: Op, meta: tuple[torch.Tensor, ...]
) -> None:
    """The kernel writes what its twin writes, and nothing else of the zeroed t."""
    t_kernel, t_twin = p.t_zeros(), p.t_zeros()
    kernel(p.x, p.pool, p.a_offsets, p.ranks, *meta, t_kernel)
    twin(p.x, p.pool, p.a_offsets, p.ranks, *meta, t_twin)
    assert_close(t_kernel, t_twin, case.dtype)
    assert not bool(t_kernel[~p.written].any()), "wrote outside adapter rows or ranks"


def check_expand(
    case: Case, p: Problem, kernel: Op, twin: Op, meta: tuple[torch.Tensor, ...]
) -> None:
    """From the same t (NaN wherever shrink does not write) the kernel adds what its twin adds,
    with and without DoRA scales, and leaves rows of tokens without an adapter bit for bit as
    they were."""
    t = per_token_loop(case)[0].float().to(p.x.device)
    base_rows = [i for i, s in enumerate(p.token_slots) if s is None]
    for scale_offsets in (None, p.scale_offsets):
        y_kernel, y_twin = p.y0.clone(), p.y0.clone()
        kernel(t, p.pool, p.b_offsets, p.offsets, p.ranks, *meta, y_kernel, scale_offsets)
        twin(t, p.pool, p.b_offsets, p.offsets, p.ranks, *meta, y_twin, scale_offsets)
        assert_close(y_kernel.float(), y_twin.float(), case.dtype)
        assert torch.equal(y_kernel[base_rows], p.y0[base_rows]), "touched a row without adapter"
