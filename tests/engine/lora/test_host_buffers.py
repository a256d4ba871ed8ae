"""The host-buffer pool: buffers come back and are reused, its size is bounded, and adapters
parsed into its buffers equal adapters parsed into fresh tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.peft_format import load_peft_adapter
from loramux.engine.lora.host_buffers import (
    MIN_BUFFER_FLOATS,
    HostBufferPool,
    adapter_floats,
    move_into,
    size_class,
)


def test_a_returned_buffer_is_reused_for_the_next_adapter_that_fits() -> None:
    pool = HostBufferPool(capacity=2, pinned=False)
    first = pool.take(10_000)
    pool.give_back(first)
    again = pool.take(9_000)
    assert again is first
    counts = pool.counts()
    assert (counts.in_use, counts.free, counts.allocated) == (1, 0, 1)


def test_a_buffer_wastes_at_most_an_eighth_and_sizes_fall_in_few_classes() -> None:
    for n in [1, 100, MIN_BUFFER_FLOATS, MIN_BUFFER_FLOATS + 1, 9_000, 10**6, 42_074_112]:
        size = size_class(n)
        assert size >= n and size >= MIN_BUFFER_FLOATS
        assert size - max(n, MIN_BUFFER_FLOATS) <= max(n, MIN_BUFFER_FLOATS) / 8
    assert size_class(MIN_BUFFER_FLOATS) == MIN_BUFFER_FLOATS
    assert size_class(1 << 20) == 1 << 20
    # A rank-16 adapter of Llama-3-8B's shape: 46.1M floats, not 2**26 (67.1M).
    assert size_class(42_074_112) == 11 << 22
    classes = {size_class(n) for n in range((1 << 16) + 1, (1 << 17) + 1)}
    assert len(classes) == 8


def test_the_smallest_free_buffer_that_fits_is_taken() -> None:
    pool = HostBufferPool(capacity=3, pinned=False)
    small, large = pool.take(MIN_BUFFER_FLOATS), pool.take(8 * MIN_BUFFER_FLOATS)
    pool.give_back(large)
    pool.give_back(small)
    assert pool.take(MIN_BUFFER_FLOATS // 2) is small
    assert pool.take(2 * MIN_BUFFER_FLOATS) is large


def test_buffers_kept_never_exceed_the_capacity() -> None:
    pool = HostBufferPool(capacity=2, pinned=False)
    for size in (1, 10, 100, 1_000, 100_000, 1_000_000):
        a, b = pool.take(size), pool.take(size * 3)
        pool.give_back(a)
        pool.give_back(b)
        counts = pool.counts()
        assert counts.in_use == 0 and counts.free <= 2


def test_taking_past_the_capacity_or_returning_a_stranger_is_an_internal_error() -> None:
    pool = HostBufferPool(capacity=1, pinned=False)
    pool.take(5)
    with pytest.raises(AssertionError):
        pool.take(5)
    with pytest.raises(AssertionError):
        pool.give_back(torch.empty(MIN_BUFFER_FLOATS))


def test_an_adapter_parsed_into_a_pool_buffer_equals_a_fresh_parse(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    pool = HostBufferPool(capacity=10, pinned=False)
    for folder in demo_adapter_dirs[:5]:
        fresh = load_peft_adapter(folder, base)
        pooled = load_peft_adapter(folder, base, storage=pool.take)
        moved = move_into(fresh, pool.take(adapter_floats(fresh)))
        for adapter in (pooled, moved):
            assert adapter.digest == fresh.digest
            assert adapter.modules.keys() == fresh.modules.keys()
            for key, weights in fresh.modules.items():
                assert torch.equal(adapter.modules[key].a, weights.a)
                assert torch.equal(adapter.modules[key].b, weights.b)
