"""Device adapter memory in the LoRA manager: adapters hold regions at their own ranks, the
least recently used unpinned ones make room, pinned ones never move, and an adapter larger
than the whole pool is refused when it is registered."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loramux.adapters.errors import OverMemoryBudget
from loramux.adapters.layout import LoraStack
from loramux.adapters.peft_format import AdapterLimits
from loramux.engine.lora.manager import LoraManager
from loramux.engine.lora.stats import Readiness
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import Sequence
from tests.adapters.peft_adapters import make_peft_adapter, tiny_base

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL_16 = LoraStack.full_rank_elements(tiny_base(), 16)
"""Pool elements of a rank-16 adapter on every projection of the tiny model."""


def manager(pool_elements: int, max_loras: int = 32) -> LoraManager:
    return LoraManager(
        tiny_base(), max_loras, 64, AdapterLimits(max_rank=16), torch.float32, "cpu",
        memory_bytes=pool_elements * 4,
    )  # fmt: skip


def register(lm: LoraManager, folder: Path, rank: int, seed: int) -> str:
    return lm.register(make_peft_adapter(folder, r=rank, target_modules=ALL_SEVEN, seed=seed))


def seq(digest: str, name: str = "s") -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams(), adapter_id=digest)


def device(lm: LoraManager) -> set[str]:
    return {d for d, tier in lm.resident().items() if tier == "device"}


def test_without_a_budget_the_pool_holds_max_loras_adapters_of_the_maximum_rank() -> None:
    lm = LoraManager(tiny_base(), 3, 8, AdapterLimits(max_rank=16), torch.bfloat16, "cpu")
    assert lm.memory() == (0, 3 * FULL_16 * 2)


def test_many_small_adapters_fit_where_two_large_ones_do(tmp_path: Path) -> None:
    lm = manager(2 * FULL_16)
    small = [register(lm, tmp_path / f"s{i}", 4, i) for i in range(8)]
    for i, digest in enumerate(small):
        assert lm.readiness(seq(digest)) is Readiness.READY
        lm.acquire(seq(digest, f"r{i}"))
    assert device(lm) == set(small), "eight rank-4 adapters take the memory of two rank-16 ones"
    used, total = lm.memory()
    assert used == total == 2 * FULL_16 * 4
    assert {lm.stats[d].device_bytes for d in small} == {FULL_16 // 4 * 4}


def test_a_large_adapter_evicts_least_recent_unpinned_ones_until_it_fits(tmp_path: Path) -> None:
    lm = manager(2 * FULL_16)
    small = [register(lm, tmp_path / f"s{i}", 4, i) for i in range(8)]
    for i, digest in enumerate(small):
        lm.acquire(seq(digest, f"r{i}"))
    for i in (0, 1, 2, 3, 6):  # leaves small[4], [5] and [7] pinned
        lm.release(seq(small[i], f"r{i}"))
    for i in (3, 6, 1, 0, 2):  # the use order: 3 longest ago
        lm.slot_of(small[i])
    large = register(lm, tmp_path / "large", 16, 99)
    assert lm.readiness(seq(large)) is Readiness.READY
    lm.acquire(seq(large, "big"))
    evicted = set(small) - device(lm)
    assert {small[4], small[5], small[7]} <= device(lm), "pinned adapters never move"
    assert large in device(lm) and small[3] in evicted
    assert evicted <= {small[i] for i in (0, 1, 2, 3, 6)}
    assert all(lm.stats[d].evictions == 1 and lm.stats[d].device_bytes == 0 for d in evicted)
    used, _ = lm.memory()
    assert used == sum(lm.stats[d].device_bytes for d in device(lm))


def test_an_adapter_that_cannot_fit_beside_pinned_ones_waits(tmp_path: Path) -> None:
    lm = manager(2 * FULL_16)
    small = [register(lm, tmp_path / f"s{i}", 4, i) for i in range(8)]
    for i, digest in enumerate(small):
        lm.acquire(seq(digest, f"r{i}"))
    for i in (0, 2, 4, 6):  # every other region unpinned: no two free neighbours
        lm.release(seq(small[i], f"r{i}"))
    large = register(lm, tmp_path / "large", 16, 99)
    assert lm.readiness(seq(large)) is Readiness.NO_SLOT, "four holes of a quarter never join"
    lm.release(seq(small[1], "r1"))
    assert lm.readiness(seq(large)) is Readiness.NO_SLOT, "regions 0-2 join: 3 of 4 quarters"
    lm.release(seq(small[3], "r3"))
    assert lm.readiness(seq(large)) is Readiness.READY, "regions 0-4 join: 5 quarters"
    lm.acquire(seq(large, "big"))
    assert {small[5], small[7]} <= device(lm)


def test_a_large_adapter_that_would_evict_may_defer_to_small_ones(tmp_path: Path) -> None:
    lm = manager(2 * FULL_16)
    small = [register(lm, tmp_path / f"s{i}", 4, i) for i in range(6)]
    for i, digest in enumerate(small):
        lm.acquire(seq(digest, f"r{i}"))
        lm.release(seq(digest, f"r{i}"))
    large = register(lm, tmp_path / "large", 16, 99)
    late_small = register(lm, tmp_path / "late", 4, 98)
    assert lm.readiness(seq(large), may_defer=False) is Readiness.READY
    assert lm.readiness(seq(large), may_defer=True) is Readiness.NO_SLOT, "it would evict"
    assert lm.readiness(seq(late_small), may_defer=True) is Readiness.READY, "a small one fits"
    lm.acquire(seq(late_small, "late"))
    assert lm.readiness(seq(large), may_defer=True) is Readiness.NO_SLOT
    lm.acquire(seq(large, "big"))  # the scheduler stops deferring after a bounded wait
    assert large in device(lm) and late_small in device(lm)
    roomy = manager(4 * FULL_16)
    large_alone = register(roomy, tmp_path / "large2", 16, 97)
    assert roomy.readiness(seq(large_alone), may_defer=True) is Readiness.READY, "fits free"


def test_the_slot_table_bounds_resident_adapters_too(tmp_path: Path) -> None:
    lm = manager(2 * FULL_16, max_loras=2)
    a, b, c = (register(lm, tmp_path / f"s{i}", 4, i) for i in range(3))
    lm.acquire(seq(a, "a"))
    lm.acquire(seq(b, "b"))
    assert lm.readiness(seq(c)) is Readiness.NO_SLOT
    lm.release(seq(a, "a"))
    lm.acquire(seq(c, "c"))
    assert device(lm) == {b, c}


def test_an_adapter_larger_than_the_whole_pool_is_refused_at_registration(
    tmp_path: Path,
) -> None:
    lm = manager(FULL_16 // 2)
    with pytest.raises(OverMemoryBudget, match="device memory"):
        register(lm, tmp_path / "large", 16, 0)
    assert lm.resident() == {} and lm.memory() == (0, FULL_16 // 2 * 4)
    fits = register(lm, tmp_path / "small", 4, 1)
    assert lm.readiness(seq(fits)) is Readiness.READY


def test_a_retired_adapter_gives_its_memory_back_when_its_last_request_ends(
    tmp_path: Path,
) -> None:
    lm = manager(2 * FULL_16)
    digest = register(lm, tmp_path / "a", 16, 0)
    assert lm.add_users([seq(digest, "r")])
    lm.acquire(seq(digest, "r"))
    lm.retire(digest)
    lm.sweep()
    assert lm.memory()[0] == FULL_16 * 4, "still in use"
    lm.release(seq(digest, "r"))
    lm.remove_user(seq(digest, "r"))
    lm.sweep()
    assert lm.memory() == (0, 2 * FULL_16 * 4) and lm.regions.free_ranges() == [(0, 2 * FULL_16)]
    assert lm.resident() == {}
