"""Regions of the adapter pool: first fit, coalescing on release, and whether a region fits
once given regions are released."""

from __future__ import annotations

import itertools
import random

import pytest

from loramux.engine.lora.memory import RegionAllocator


def test_regions_go_to_the_first_free_range_they_fit() -> None:
    pool = RegionAllocator(100)
    assert [pool.allocate(n) for n in (10, 20, 30)] == [0, 10, 30]
    pool.release(10, 20)
    assert pool.allocate(25) == 60, "the hole of 20 is too short: the tail range serves"
    assert pool.allocate(15) == 10, "the hole is first and long enough"
    assert pool.allocate(16) is None and pool.largest_free == 15
    assert (pool.used, pool.free) == (80, 20)


def test_released_neighbours_merge_into_one_range() -> None:
    pool = RegionAllocator(90)
    starts = [pool.allocate(30) for _ in range(3)]
    assert starts == [0, 30, 60] and pool.free == 0
    pool.release(0, 30)
    pool.release(60, 30)
    assert pool.free_ranges() == [(0, 30), (60, 90)] and pool.allocate(31) is None
    pool.release(30, 30)
    assert pool.free_ranges() == [(0, 90)]
    assert pool.allocate(90) == 0 and pool.free_ranges() == []


def test_fragmentation_is_undone_by_releasing_in_any_order() -> None:
    rng = random.Random(3)
    pool = RegionAllocator(1000)
    held: list[tuple[int, int]] = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            pool.release(*held.pop(rng.randrange(len(held))))
        else:
            length = rng.randint(1, 80)
            start = pool.allocate(length)
            if start is not None:
                assert all(start + length <= s or e <= start for s, e in pool.free_ranges())
                held.append((start, length))
        ranges = pool.free_ranges()
        assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(ranges))
        assert pool.used == sum(n for _, n in held)
    for region in held:
        pool.release(*region)
    assert pool.free_ranges() == [(0, 1000)]


def test_a_region_fits_after_release_only_where_the_freed_ranges_join() -> None:
    pool = RegionAllocator(100)
    a, b, c, d = (pool.allocate(25) for _ in range(4))
    assert None not in (a, b, c, d) and pool.largest_free == 0
    assert not pool.fits_after_release(50, [(0, 25), (50, 25)]), "two holes of 25 apart"
    assert pool.fits_after_release(50, [(25, 25), (50, 25)]), "neighbours merge into 50"
    assert pool.fits_after_release(100, [(0, 25), (25, 25), (50, 25), (75, 25)])
    assert pool.free == 0, "asking changes nothing"


def test_an_empty_pool_or_region_is_refused() -> None:
    with pytest.raises(ValueError):
        RegionAllocator(0)
    with pytest.raises(AssertionError):
        RegionAllocator(10).allocate(0)
