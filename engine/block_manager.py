"""Paged KV-cache bookkeeping: block allocation, reference counts and the prefix cache.

A block holds `block_size` consecutive tokens of one sequence. A *full* block is also
identified by a `PrefixHash`: a chained hash of the previous block's hash and this block's
token ids. The chain starts at a root made of the sequence's adapter identity and its cache
salt, so equal hashes mean equal prefixes under the same adapter and the same salt: KV computed
under one adapter or one salt (a tenant, say) is never found under another. A cache hit is
re-checked against the tokens stored with the block.

Forked sequences (the choices of one request) share their prompt's blocks, the last one
partial, by reference count: a sequence about to write into a block others still hold gets a
copy of it first (copy-on-write; `take_copies` hands the (source, destination) pairs to the
runner, which copies the KV on the device before the step's forward pass).

Free blocks are kept in least-recently-freed order. A freed block that carries a hash stays
findable in the prefix cache until it is handed out again (evicted) — hash-less free blocks
are handed out first, then hashed ones oldest first.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from loramux.engine.sequence import Sequence

PrefixHash = bytes


@functools.lru_cache(maxsize=1024)
def prefix_root(adapter_id: str, cache_salt: str | None) -> PrefixHash:
    """The hash a sequence's chain starts from. Each part is length-prefixed and a missing salt
    is told apart from an empty one, so no two (adapter, salt) pairs share a root."""
    h = hashlib.blake2b(digest_size=16, person=b"loramux-prefix")
    for part in (adapter_id, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            data = part.encode("utf-8", "surrogatepass")  # a lone surrogate hashes too
            h.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    return h.digest()


def prefix_hash(parent: PrefixHash, token_ids: list[int]) -> PrefixHash:
    """Chained block hash: the previous block's hash (or the root) and this block's token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


def _root(seq: Sequence) -> PrefixHash:
    return prefix_root(seq.adapter_id, seq.cache_salt)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: PrefixHash | None = None
    token_ids: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class BlockStats:
    total: int
    used: int
    free: int
    cached_free: int
    """Free blocks that still hold a reusable prefix."""


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a sequence: its blocks and their chained hashes, in order."""

    block_ids: tuple[int, ...]
    hashes: tuple[PrefixHash, ...]
    num_tokens: int


@dataclass(frozen=True)
class Allocation:
    """What admitting a sequence takes: its cached prefix and the uncached tokens its first
    chunk computes. `can_allocate` makes it and `allocate` consumes it, with no change to the
    pool in between (both run within one `Scheduler.schedule`)."""

    prefix: PrefixMatch
    num_new_tokens: int

    @property
    def num_cached_tokens(self) -> int:
        return self.prefix.num_tokens


class BlockManager:
    """Owns the pool of KV blocks and each sequence's block table.

    Methods come in pairs: `can_allocate`/`allocate` admit a sequence (matching its prefix
    once), `can_append`/`append` grow it for the tokens of the next step. `free` releases a
    sequence's blocks; `seal_full_blocks` publishes newly computed full blocks in the prefix
    cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached_free = 0
        """Free blocks that carry a hash (findable in the prefix cache), counted as they change:
        `stats` is read off the step thread, and iterating `_free` there raised when the step
        thread changed it meanwhile (and cost a pass over the pool per scrape)."""
        self._by_hash: dict[PrefixHash, int] = {}
        # Hash of each sequence's sealed blocks, so sealing stays O(new blocks).
        self._seq_hashes: dict[Sequence, list[PrefixHash]] = {}
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def stats(self) -> BlockStats:
        free = len(self._free)
        return BlockStats(len(self.blocks), len(self.blocks) - free, free, self._cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of `seq`, leaving at least one token to compute."""
        block_ids: list[int] = []
        hashes: list[PrefixHash] = []
        if self.enable_prefix_caching:
            parent = _root(seq)
            for i in range((len(seq) - 1) // self.block_size):
                tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
                parent = prefix_hash(parent, tokens)
                block_id = self._by_hash.get(parent)
                if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                    break
                block_ids.append(block_id)
                hashes.append(parent)
        return PrefixMatch(tuple(block_ids), tuple(hashes), len(block_ids) * self.block_size)

    def can_allocate(self, seq: Sequence, token_budget: int) -> Allocation | None:
        """How `seq` would be admitted to compute up to `token_budget` of its uncached tokens;
        None when the free blocks cannot hold that."""
        prefix = self.match_prefix(seq)
        num_new = min(len(seq) - prefix.num_tokens, token_budget)
        reclaimed = sum(1 for b in prefix.block_ids if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(prefix.num_tokens + num_new) - len(prefix.block_ids)
        if needed > self.num_free_blocks - reclaimed:
            return None
        return Allocation(prefix, num_new)

    def allocate(self, seq: Sequence, allocation: Allocation) -> None:
        """Attach the cached prefix to `seq` and give it the blocks of its first chunk."""
        assert not seq.block_table, "sequence already holds blocks"
        for block_id, h in zip(allocation.prefix.block_ids, allocation.prefix.hashes, strict=True):
            block = self.blocks[block_id]
            assert block.hash == h, "the pool changed between can_allocate and allocate"
            if block.ref_count == 0:
                del self._free[block_id]
                self._cached_free -= 1  # a prefix block carries its hash
            block.ref_count += 1
        seq.block_table = list(allocation.prefix.block_ids)
        self._seq_hashes[seq] = list(allocation.prefix.hashes)
        seq.num_computed_tokens = allocation.num_cached_tokens
        self.append(seq, allocation.num_new_tokens)

    # -- growth ------------------------------------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        copy = self._shared_write_block(seq) is not None
        return needed - len(seq.block_table) + copy <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` enough blocks to hold `num_new_tokens` more computed tokens, copying the
        block it writes first if other sequences share it."""
        shared = self._shared_write_block(seq)
        if shared is not None:
            source = seq.block_table[shared]
            self.blocks[source].ref_count -= 1  # others still hold it: never 0 here
            seq.block_table[shared] = self._take_free_block()
            self._copies.append((source, seq.block_table[shared]))
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """The index in `seq`'s table of the block its next token goes to, when that block is
        shared with a fork (only a prompt's last, partial block can be: full blocks are never
        written again)."""
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` `parent`'s blocks and computed positions (shared, by reference)."""
        assert not child.block_table, "a fork starts without blocks"
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        self._seq_hashes[child] = list(self._seq_hashes.get(parent, []))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies owed since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: this prefix is no longer findable
            self._cached_free -= 1
            if self._by_hash.get(block.hash) == block_id:
                del self._by_hash[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def seal_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish every full block of `seq` within its first `num_tokens` positions (tokens
        known and KV computed) not yet in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq, [])
        for i in range(len(hashes), num_tokens // self.block_size):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            h = prefix_hash(hashes[-1] if hashes else _root(seq), tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._by_hash:
                block.hash, block.token_ids = h, tuple(tokens)
                self._by_hash[h] = block.block_id

    # -- release -----------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; hashed ones stay findable until evicted. Newest last in LRU."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, "block freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._cached_free += 1
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._seq_hashes.pop(seq, None)
