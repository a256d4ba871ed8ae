"""The adapter pool's size, and its regions: first-fit allocation over free ranges, neighbours
coalesced on free. Sizes and starts are pool elements (adapters.layout). Which regions to free
when a new one does not fit is the manager's choice (least recently used unpinned adapters
first); this module only answers where a region goes, and whether one would fit once given
ranges are free.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.layout import LoraStack

DEFAULT_FULL_RANK_ADAPTERS = 8
"""Without a memory budget, the pool holds this many adapters of the maximum rank on every
projection (at most `max_loras`): residency then follows the adapters' real sizes. So at most
this many such adapters run in one step, whatever `max_loras` is: size the memory with
`full_rank_bytes` to run more."""


def full_rank_bytes(base: BaseModelSpec, adapters: int, rank: int, dtype: torch.dtype) -> int:
    """Device memory for `adapters` adapters of `rank` on every projection of `base`."""
    element = torch.empty(0, dtype=dtype).element_size()
    return adapters * LoraStack.full_rank_elements(base, rank) * element


def pool_elements(
    base: BaseModelSpec, max_loras: int, max_rank: int, memory_bytes: int | None, dtype: torch.dtype
) -> int:
    """The pool's size in elements: `memory_bytes`, or by default room for
    min(max_loras, DEFAULT_FULL_RANK_ADAPTERS) adapters of `max_rank`."""
    if memory_bytes is None:
        memory_bytes = full_rank_bytes(
            base, min(max_loras, DEFAULT_FULL_RANK_ADAPTERS), max_rank, dtype
        )
    return memory_bytes // torch.empty(0, dtype=dtype).element_size()


class RegionAllocator:
    """Free ranges of a pool of `size` elements, kept sorted by start and never adjacent."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"the pool needs at least one element, not {size}")
        self.size = size
        self._starts: list[int] = [0]
        self._ends: list[int] = [size]

    @property
    def free(self) -> int:
        """Free elements in all ranges together."""
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def used(self) -> int:
        return self.size - self.free

    @property
    def largest_free(self) -> int:
        """The longest free range: the largest region that fits now."""
        return max((e - s for s, e in zip(self._starts, self._ends, strict=True)), default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(start, end) of every free range, in pool order."""
        return list(zip(self._starts, self._ends, strict=True))

    def allocate(self, length: int) -> int | None:
        """The start of a new region of `length` in the first free range it fits; None if none."""
        assert length > 0, "regions are never empty"
        for index, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= length:
                if end - start == length:
                    del self._starts[index], self._ends[index]
                else:
                    self._starts[index] = start + length
                return start
        return None

    def release(self, start: int, length: int) -> None:
        """Return the region [start, start + length) to the free ranges, merged with neighbours."""
        end = start + length
        index = bisect.bisect_left(self._starts, start)
        assert 0 <= start < end <= self.size, "region outside the pool"
        assert index == len(self._starts) or end <= self._starts[index], (
            "region overlaps a free one"
        )
        assert index == 0 or self._ends[index - 1] <= start, "region overlaps a free one"
        joins_before = index > 0 and self._ends[index - 1] == start
        joins_after = index < len(self._starts) and self._starts[index] == end
        if joins_before and joins_after:
            self._ends[index - 1] = self._ends[index]
            del self._starts[index], self._ends[index]
        elif joins_before:
            self._ends[index - 1] = end
        elif joins_after:
            self._starts[index] = start
        else:
            self._starts.insert(index, start)
            self._ends.insert(index, end)

    def fits_after_release(self, length: int, regions: Iterable[tuple[int, int]]) -> bool:
        """Whether a region of `length` would fit once the given (start, length) regions are
        released too (nothing changes)."""
        if self.largest_free >= length:
            return True
        trial = RegionAllocator(self.size)
        trial._starts, trial._ends = list(self._starts), list(self._ends)
        for start, size in regions:
            trial.release(start, size)
        return trial.largest_free >= length
