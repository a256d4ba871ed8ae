"""Multi-LoRA shrink/expand: every Triton kernel equals its torch twin (interpreted on CPU,
compiled on a GPU), and the twins equal a dead-simple per-token float64 loop, over the problems
of `tests.kernels.lora_problems`."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from loramux.kernels.lora_expand import bgmv_expand, sgmv_expand
from loramux.kernels.lora_meta import NO_SLOT, LoraMetaBuffers
from loramux.kernels.lora_ref import (
    bgmv_expand_ref,
    bgmv_shrink_ref,
    sgmv_expand_ref,
    sgmv_shrink_ref,
)
from loramux.kernels.lora_shrink import (
    bgmv_shrink,
    bgmv_shrink_tiles,
    sgmv_shrink,
    sgmv_shrink_tiles,
)
from tests.kernels.lora_problems import (
    CASES,
    KERNEL_DEVICE,
    Case,
    Layout,
    Op,
    Problem,
    assert_close,
    check_expand,
    check_shrink,
    make_problem,
    needs_cuda,
    per_token,
    per_token_loop,
    segments,
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sgmv_shrink_matches_twin(case: Case) -> None:
    p = make_problem(case).to(KERNEL_DEVICE)
    check_shrink(case, p, sgmv_shrink, sgmv_shrink_ref, segments(p))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sgmv_expand_matches_twin(case: Case) -> None:
    p = make_problem(case).to(KERNEL_DEVICE)
    check_expand(case, p, sgmv_expand, sgmv_expand_ref, segments(p))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bgmv_shrink_matches_twin(case: Case) -> None:
    p = make_problem(case).to(KERNEL_DEVICE)
    check_shrink(case, p, bgmv_shrink, bgmv_shrink_ref, per_token(p))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bgmv_expand_matches_twin(case: Case) -> None:
    p = make_problem(case).to(KERNEL_DEVICE)
    check_expand(case, p, bgmv_expand, bgmv_expand_ref, per_token(p))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_twins_match_per_token_fp64_loop(case: Case) -> None:
    p = make_problem(case)
    t_loop, y_loop, y_dora = per_token_loop(case)
    layouts: list[tuple[Op, Op, tuple[torch.Tensor, ...]]] = [
        (sgmv_shrink_ref, sgmv_expand_ref, segments(p)),
        (bgmv_shrink_ref, bgmv_expand_ref, per_token(p)),
    ]
    for shrink, expand, meta in layouts:
        t = p.t_zeros()
        shrink(p.x, p.pool, p.a_offsets, p.ranks, *meta, t)
        assert not bool(t[~p.written].any())
        t = torch.where(p.written, t, math.nan)
        assert_close(t, t_loop, "fp32")
        for scale_offsets, expected in ((None, y_loop), (p.scale_offsets, y_dora)):
            y = p.y0.clone()
            expand(t, p.pool, p.b_offsets, p.offsets, p.ranks, *meta, y, scale_offsets)
            assert_close(y, expected, case.dtype)


SPLIT_CASE = Case("fp32", 1024, "16", 1, "one", "o")


@pytest.mark.parametrize(
    ("kernel", "twin", "layout"),
    [(sgmv_shrink, sgmv_shrink_ref, segments), (bgmv_shrink, bgmv_shrink_ref, per_token)],
)
def test_shrink_of_few_tokens_splits_hidden_and_adds_the_parts(
    kernel: Op, twin: Op, layout: Layout
) -> None:
    assert sgmv_shrink_tiles(num_tokens=1, num_segs=1, hidden=1024, rank=16, slices=1).split_k > 1
    assert bgmv_shrink_tiles(num_tokens=1, hidden=1024, rank=16, slices=1).split_k > 1
    p = make_problem(SPLIT_CASE).to(KERNEL_DEVICE)
    check_shrink(SPLIT_CASE, p, kernel, twin, layout(p))


GPU_CASES = [  # serving sizes: hidden 4096, ranks 8-64, batches 1-256
    Case("bf16", 4096, "mixed", 1, "one", "qkv"),
    Case("bf16", 4096, "mixed", 16, "distinct", "qkv"),
    Case("bf16", 4096, "mixed", 256, "zipf", "gate_up"),
    Case("fp16", 4096, "16", 256, "uniform", "o"),
    Case("bf16", 4096, "8", 256, "distinct", "o"),
    Case("fp32", 4096, "64", 64, "some_none", "qkv_v_off"),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize(
    ("kernel", "twin", "layout", "check"),
    [
        (sgmv_shrink, sgmv_shrink_ref, segments, check_shrink),
        (sgmv_expand, sgmv_expand_ref, segments, check_expand),
        (bgmv_shrink, bgmv_shrink_ref, per_token, check_shrink),
        (bgmv_expand, bgmv_expand_ref, per_token, check_expand),
    ],
    ids=["sgmv_shrink", "sgmv_expand", "bgmv_shrink", "bgmv_expand"],
)
@pytest.mark.gpu
@needs_cuda
def test_compiled_kernels_match_twins_at_serving_sizes(
    case: Case, kernel: Op, twin: Op, layout: Layout, check: Callable[..., None]
) -> None:
    p = make_problem(case).to(torch.device("cuda"))
    check(case, p, kernel, twin, layout(p))


def per_token_padded(p: Problem) -> tuple[torch.Tensor, ...]:
    """Every row listed, rows without an adapter as NO_SLOT (a CUDA graph's layout)."""
    meta = LoraMetaBuffers(len(p.token_slots), p.x.device).build(
        p.token_slots, pad_to=len(p.token_slots)
    )
    return meta.token_indices, meta.token_slots


PADDED_CASES = [c for c in CASES if c.spread == "some_none"]


@pytest.mark.parametrize("case", PADDED_CASES, ids=str)
@pytest.mark.parametrize(
    ("kernel", "twin", "check"),
    [(bgmv_shrink, bgmv_shrink_ref, check_shrink), (bgmv_expand, bgmv_expand_ref, check_expand)],
    ids=["bgmv_shrink", "bgmv_expand"],
)
def test_per_token_kernels_skip_rows_without_a_slot(
    case: Case, kernel: Op, twin: Op, check: Callable[..., None]
) -> None:
    p = make_problem(case).to(KERNEL_DEVICE)
    meta = per_token_padded(p)
    assert int((meta[1] == NO_SLOT).sum()) == p.token_slots.count(None) > 0
    check(case, p, kernel, twin, meta)
