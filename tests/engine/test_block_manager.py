"""Block allocation, reference counts, the prefix cache and its LRU eviction."""

from __future__ import annotations

from engine.block_manager import BlockManager, prefix_root
from engine.sampling import SamplingParams
from engine.sequence import Sequence


def _seq(name: str, tokens: list[int], adapter: str = "base", salt: str | None = None) -> Sequence:
    return Sequence(name, tokens, SamplingParams(), 0, adapter_id=adapter, cache_salt=salt)


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """Admit `seq` and pretend its whole prompt was computed."""
    bm.allocate(seq)
    bm.append(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.seal_full_blocks(seq)


def test_blocks_grow_with_the_sequence_not_its_maximum() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq("a", [1, 2, 3])
    bm.allocate(seq)
    bm.append(seq, 3)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 3
    bm.append(seq, 2)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6


def test_shared_prefix_is_reference_counted_and_stays_cached_after_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq("a", list(range(10)))
    _compute(bm, a)
    b = _seq("b", [*range(8), 99, 98])
    assert bm.allocate(b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:2])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    c = _seq("c", list(range(10)))
    assert bm.allocate(c) == 8, "freed blocks remain findable until evicted"


def test_the_last_token_is_always_computed() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    _compute(bm, _seq("a", list(range(8))))
    again = _seq("b", list(range(8)))
    assert bm.allocate(again) == 4, "a fully cached prompt still computes its last block"


def test_adapter_identity_is_part_of_the_hash() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    _compute(bm, _seq("a", list(range(9)), adapter="digest-1"))
    assert bm.allocate(_seq("b", list(range(9)), adapter="digest-2")) == 0
    assert bm.allocate(_seq("c", list(range(9)), adapter="digest-1")) == 8


def test_cache_salt_is_part_of_the_hash() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    _compute(bm, _seq("a", list(range(9)), salt="tenant-a"))
    _compute(bm, _seq("d", list(range(9)), adapter="digest-1", salt="tenant-a"))
    assert bm.allocate(_seq("b", list(range(9)), salt="tenant-b")) == 0
    assert bm.allocate(_seq("none", list(range(9)))) == 0
    assert bm.allocate(_seq("empty", list(range(9)), salt="")) == 0
    assert bm.allocate(_seq("other", list(range(9)), adapter="digest-2", salt="tenant-a")) == 0
    assert bm.allocate(_seq("c", list(range(9)), salt="tenant-a")) == 8
    assert bm.allocate(_seq("e", list(range(9)), adapter="digest-1", salt="tenant-a")) == 8


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
    assert bm.allocate(_seq("b", list(range(9)))) == 0


def test_eviction_is_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    old, new = _seq("old", list(range(5))), _seq("new", list(range(100, 105)))
    _compute(bm, old)
    _compute(bm, new)
    bm.free(old)
    bm.free(new)
    filler = _seq("f", list(range(200, 206)))
    bm.allocate(filler)
    bm.append(filler, 6)  # takes the 2 hash-less blocks, then must evict one cached block
    bm.append(filler, 9)
    assert bm.allocate(_seq("o2", list(range(5)))) == 0, "the older prefix was evicted"
    assert bm.allocate(_seq("n2", list(range(100, 105)))) == 4, "the newer prefix survived"
