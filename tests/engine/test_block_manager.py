"""Block allocation, reference counts, the prefix cache and its LRU eviction."""

from __future__ import annotations

import random

from loramux.engine.block_manager import BlockManager, prefix_root
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import Sequence


def _seq(name: str, tokens: list[int], adapter: str = "base", salt: str | None = None) -> Sequence:
    return Sequence(name, tokens, SamplingParams(), adapter_id=adapter, cache_salt=salt)


def _admit(bm: BlockManager, seq: Sequence, budget: int = 1 << 20) -> int:
    """Admit `seq` to compute up to `budget` uncached tokens; the tokens found cached."""
    allocation = bm.can_allocate(seq, budget)
    assert allocation is not None, "the pool was meant to hold it"
    bm.allocate(seq, allocation)
    return allocation.num_cached_tokens


def _cached(bm: BlockManager, seq: Sequence) -> int:
    return bm.match_prefix(seq).num_tokens


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """Admit `seq` and pretend its whole prompt was computed."""
    _admit(bm, seq)
    seq.num_computed_tokens = len(seq)
    bm.seal_full_blocks(seq, len(seq))


def test_blocks_grow_with_the_sequence_not_its_maximum() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq("a", [1, 2, 3])
    _admit(bm, seq)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 3
    bm.append(seq, 2)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6


def test_shared_prefix_is_reference_counted_and_stays_cached_after_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq("a", list(range(10)))
    _compute(bm, a)
    b = _seq("b", [*range(8), 99, 98])
    assert _admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:2])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    c = _seq("c", list(range(10)))
    assert _admit(bm, c) == 8, "freed blocks remain findable until evicted"


def test_the_last_token_is_always_computed() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    _compute(bm, _seq("a", list(range(8))))
    again = _seq("b", list(range(8)))
    assert _admit(bm, again) == 4, "a fully cached prompt still computes its last block"


def test_adapter_identity_is_part_of_the_hash() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    _compute(bm, _seq("a", list(range(9)), adapter="digest-1"))
    assert _cached(bm, _seq("b", list(range(9)), adapter="digest-2")) == 0
    assert _cached(bm, _seq("c", list(range(9)), adapter="digest-1")) == 8


def test_cache_salt_is_part_of_the_hash() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    _compute(bm, _seq("a", list(range(9)), salt="tenant-a"))
    _compute(bm, _seq("d", list(range(9)), adapter="digest-1", salt="tenant-a"))
    assert _cached(bm, _seq("b", list(range(9)), salt="tenant-b")) == 0
    assert _cached(bm, _seq("none", list(range(9)))) == 0
    assert _cached(bm, _seq("empty", list(range(9)), salt="")) == 0
    assert _cached(bm, _seq("other", list(range(9)), adapter="digest-2", salt="tenant-a")) == 0
    assert _cached(bm, _seq("c", list(range(9)), salt="tenant-a")) == 8
    assert _cached(bm, _seq("e", list(range(9)), adapter="digest-1", salt="tenant-a")) == 8


def test_no_two_adapter_and_salt_pairs_share_a_root() -> None:
    pairs = [
        ("base", None),
        ("base", ""),
        ("base", "a"),
        ("basea", None),
        ("a", "b|c"),
        ("a|b", "c"),
        ("a\x01", "b"),
        ("a", "\x01b"),
        ("base", "\ud800"),  # a lone surrogate, as JSON can carry one
    ]
    assert len({prefix_root(adapter, salt) for adapter, salt in pairs}) == len(pairs)


def test_hit_is_rechecked_against_stored_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq("a", list(range(9)))
    _compute(bm, a)
    h = bm.blocks[a.block_table[0]].hash
    bm.blocks[a.block_table[0]].token_ids = (7, 7, 7, 7)  # a hash collision, simulated
    assert h is not None
    assert _cached(bm, _seq("b", list(range(9)))) == 0


def test_eviction_is_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    old, new = _seq("old", list(range(5))), _seq("new", list(range(100, 105)))
    _compute(bm, old)
    _compute(bm, new)
    bm.free(old)
    bm.free(new)
    filler = _seq("f", list(range(200, 206)))
    _admit(bm, filler)  # takes the 2 hash-less blocks, then must evict one cached block
    bm.append(filler, 9)
    assert _cached(bm, _seq("o2", list(range(5)))) == 0, "the older prefix was evicted"
    assert _cached(bm, _seq("n2", list(range(100, 105)))) == 4, "the newer prefix survived"


def test_admission_plans_the_first_chunk_within_the_budget_and_the_free_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    _compute(bm, _seq("a", list(range(9))))  # 3 blocks, the first 2 sealed
    seq = _seq("b", [*range(8), *range(50, 58)])  # 8 cached tokens, 8 new
    allocation = bm.can_allocate(seq, token_budget=3)
    assert allocation is not None
    assert (allocation.num_cached_tokens, allocation.num_new_tokens) == (8, 3)
    assert bm.can_allocate(seq, token_budget=8) is None, "8 new tokens need 2 blocks; 1 is free"
    bm.allocate(seq, allocation)
    assert seq.block_table[:2] == [0, 1] and len(seq.block_table) == 3
    assert seq.num_computed_tokens == 8 and bm.num_free_blocks == 0


def test_forks_share_blocks_and_copy_a_shared_block_before_writing_to_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = _seq("r", [1, 2, 3, 4, 5, 6])  # one full block and a partial one
    _compute(bm, parent)
    children = [_seq("r", list(parent.token_ids)) for _ in range(2)]
    for child in children:
        bm.fork(parent, child)
        child.token_ids.append(7)  # its first sampled token
    assert bm.stats().used == 2 and all(c.block_table == parent.block_table for c in children)
    full, partial = parent.block_table

    first = children[0]
    assert bm.can_append(first, 1)
    bm.append(first, 1)  # writes position 6, in the shared partial block: copies it first
    assert first.block_table[0] == full and first.block_table[1] != partial
    assert bm.take_copies() == [(partial, first.block_table[1])] and bm.take_copies() == []

    parent.token_ids.append(8)
    bm.append(parent, 1)  # still shared with the second child: copied too
    assert parent.block_table[1] not in (partial, first.block_table[1])
    bm.append(children[1], 1)  # the last holder writes in place
    assert children[1].block_table[1] == partial and len(bm.take_copies()) == 1

    for seq in (parent, *children):
        bm.free(seq)
    assert bm.stats().used == 0 and all(b.ref_count == 0 for b in bm.blocks)


def test_a_fork_that_must_copy_needs_a_free_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = _seq("r", [1, 2, 3, 4, 5])
    _compute(bm, parent)
    child = _seq("r", list(parent.token_ids))
    bm.fork(parent, child)
    assert not bm.can_append(child, 1), "the copy of the shared block needs a free one"


def test_the_cached_free_count_follows_every_allocation_eviction_and_free() -> None:
    """`stats` keeps the number of free blocks that carry a hash as they change, instead of
    counting them by a pass over the free list: read off the step thread, that pass raised
    when the step thread changed the list meanwhile (tests/engine/test_metrics.py).
    Under shared prefixes, evictions and frees, the count is the pass's at every step."""
    rng = random.Random(7)
    pool = BlockManager(num_blocks=24, block_size=4)
    live: list[Sequence] = []
    for step in range(400):
        if live and (rng.random() < 0.4 or pool.num_free_blocks < 6):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randint(1, 8)] + [rng.randint(9, 12)] * 5
            seq = Sequence(f"s{step}", prompt, SamplingParams())
            allocation = pool.can_allocate(seq, token_budget=64)
            if allocation is not None:
                pool.allocate(seq, allocation)
                pool.seal_full_blocks(seq, len(prompt))
                live.append(seq)
        counted = sum(1 for i in pool._free if pool.blocks[i].hash is not None)
        assert pool.stats().cached_free == counted, step
    assert pool.stats().cached_free > 0
