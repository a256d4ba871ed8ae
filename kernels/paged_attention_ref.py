"""Paged attention in plain torch: the per-step metadata, the KV-cache write, and the torch twin.

The twin is both the reference the Triton kernel is tested against and the engine's CPU serving
path, so it batches work instead of looping over tokens: every decode (one query token) of a step
goes through a single padded gather and one masked batched attention, and each longer chunk
(fresh prefill, chunked prefill, continuation of a cached prefix) is one
`scaled_dot_product_attention` call over its gathered KV with the causal mask shifted to the
chunk's absolute positions.

Cache layout, per layer: `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads,
head_dim]`; position `p` of sequence `b` lives at `cache[block_tables[b, p // block_size],
p % block_size]`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's queries and KV live for one step; built once, shared by every layer.

    Invariants: `q_lens[b] >= 1`, `q_lens[b] <= seq_lens_host[b]` (a step's tokens are the last
    `q_lens[b]` of the sequence and their K/V are already in the cache), and `block_tables` has
    at least `ceil(seq_lens_host[b] / block_size)` valid block indices in row `b` (entries past
    them are any valid index). The tensors live on the device of the activations; the host
    copies give loop bounds and launch grids without a device sync.
    """

    block_tables: torch.Tensor  # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]; sequence b's queries are q[cu[b]:cu[b + 1]]
    seq_lens: torch.Tensor  # int32 [B]; total KV length, this step's tokens included
    q_lens: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    def __post_init__(self) -> None:
        batch = len(self.q_lens)
        assert len(self.seq_lens_host) == batch
        assert self.block_tables.shape[0] == batch and self.seq_lens.shape == (batch,)
        assert self.cu_seqlens_q.shape == (batch + 1,)
        assert all(1 <= n <= s for n, s in zip(self.q_lens, self.seq_lens_host, strict=True))

    @classmethod
    def build(
        cls,
        q_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from host lists; block-table rows are padded with block 0 to the longest."""
        width = max((len(row) for row in block_tables), default=0)
        padded = [list(row) + [0] * (width - len(row)) for row in block_tables]
        cu = [0, *itertools.accumulate(q_lens)]
        return cls(
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(
                len(padded), width
            ),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            q_lens=tuple(q_lens),
            seq_lens_host=tuple(seq_lens),
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)


def write_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys and values into their cache slots, in place.

    Semantics: for t in range(T): s = slot_mapping[t]  (int64, = block * block_size + offset)
                   k_cache[s // block_size, s % block_size] = k[t]   # k: [T, num_kv_heads, head_dim]
                   v_cache[s // block_size, s % block_size] = v[t]
    The caches must be contiguous (they are allocated so); k and v are cast to the cache dtype.
    """
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, slot_mapping, new.to(cache.dtype))


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each step token over its sequence's paged KV (torch twin, fp32 math).

    Semantics (q, out: [T, H, D]; caches: [N, bs, Hkv, D]; G = H // Hkv):
        for b in range(B): for j in range(q_lens[b]):
            t = cu_seqlens_q[b] + j;  pos = seq_lens[b] - q_lens[b] + j
            K = [k_cache[block_tables[b, p // bs], p % bs] for p in 0..pos]     # [pos + 1, Hkv, D]
            for h in range(H):
                out[t, h] = softmax(scale * K[:, h // G] @ q[t, h]) @ V[:, h // G]
    Accumulation is fp32; out has q's dtype.
    """
    assert q.shape[0] == meta.num_tokens
    out = torch.empty_like(q)
    starts = [0, *itertools.accumulate(meta.q_lens)]
    decodes = [b for b, n in enumerate(meta.q_lens) if n == 1]
    for group in _length_buckets(decodes, meta.seq_lens_host):
        rows = torch.tensor([starts[b] for b in group], device=q.device)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, meta, group, scale).to(q.dtype)
    for b, n in enumerate(meta.q_lens):
        if n > 1:
            chunk = _chunk_attention(
                q[starts[b] : starts[b] + n],
                _gather(k_cache, meta.block_tables[b], meta.seq_lens_host[b]),
                _gather(v_cache, meta.block_tables[b], meta.seq_lens_host[b]),
                scale,
            )
            out[starts[b] : starts[b] + n] = chunk.to(q.dtype)
    return out


DECODE_BUCKET_GROWTH = 1.5
"""A decode bucket holds sequences up to this many times longer than its shortest one."""


def _length_buckets(seqs: list[int], seq_lens: Sequence[int]) -> list[list[int]]:
    """Group decoding sequences by KV length, so each padded gather wastes at most a third of it.

    Padding every decode to the batch's longest sequence copies (and attends over) far more KV
    than exists when lengths are mixed; a few buckets cost a few more calls and copy much less.
    """
    buckets: list[list[int]] = []
    floor = 0
    for b in sorted(seqs, key=lambda b: seq_lens[b]):
        if not buckets or seq_lens[b] > DECODE_BUCKET_GROWTH * floor:
            buckets.append([])
            floor = seq_lens[b]
        buckets[-1].append(b)
    return buckets


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one sequence, contiguous: [length, Hkv, D]."""
    num_blocks = -(-length // cache.shape[1])
    return cache[blocks[:num_blocks]].flatten(0, 1)[:length]


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: list[int],
    scale: float,
) -> torch.Tensor:
    """One query per sequence in `seqs` ([S, H, D]) over KV gathered and padded to the longest.

    Each query sits at its sequence's last position, so the causal mask is just `p < seq_len`.
    Padding positions (past a sequence's end, or in the block-0 padding of its table row) hold
    whatever another request left there, NaN or infinity included: they are zeroed, since a
    masked weight of 0 times an infinite value is still NaN.
    """
    lens = [meta.seq_lens_host[b] for b in seqs]
    length = max(lens)
    index = torch.tensor(seqs, device=q.device)
    blocks = meta.block_tables[index, : -(-length // k_cache.shape[1])]
    k = k_cache[blocks].flatten(1, 2)[:, :length]  # [S, L, Hkv, D], a gathered copy
    v = v_cache[blocks].flatten(1, 2)[:, :length]
    valid = torch.arange(length, device=q.device) < torch.tensor(lens, device=q.device)[:, None]
    padding = ~valid[:, :, None, None]
    k.masked_fill_(padding, 0.0)
    v.masked_fill_(padding, 0.0)
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None],  # [S, H, 1, D]
        k.float().transpose(1, 2),
        v.float().transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0]


def _chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """A chunk's n queries ([n, H, D]) over its sequence's L keys ([L, Hkv, D]), n <= L.

    Query j sits at position L - n + j, so the causal mask is the lower triangle shifted right
    by the L - n cached positions before the chunk; with no cached prefix it is plain causal.
    """
    n, length = q.shape[0], k.shape[0]
    mask = None
    if n != length:
        q_pos = torch.arange(length - n, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
    # 4-d inputs: torch's CPU flash kernel takes them (GQA included); 3-d ones fall back to
    # the much slower math path.
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
