"""A step's model inputs, in buffers allocated once and filled in place every step.

Each per-step tensor has a fixed capacity: pinned host staging that the CPU writes, and a device
twin that one asynchronous copy fills (on the CPU they are the same tensor). A step uses the
first rows, so the device tensors keep their addresses from step to step (CUDA graphs rely on
it). Sizes, for max_num_batched_tokens T = 512, max_num_seqs S = 64 and max_model_len 2048 in
16-token blocks (W = 128 blocks per sequence):

    input_ids, positions, slot_mapping   int64 [T]        3 × 4 KiB
    logits_indices                       int64 [S]        512 B (a row forked choices share
                                                           is listed once per choice)
    cu_seqlens_q                         int32 [S + 1]    260 B
    seq_lens                             int32 [S]        256 B
    block_tables                         int32 [S, W]     32 KiB, with staging of the same size

    pending_inputs                       int64 [S, 2]     1 KiB

A step of 3 decodes and one 100-token prefill chunk, whose longest block table has w blocks,
uses input_ids[:103], logits_indices[:4], cu_seqlens_q[:5], seq_lens[:4] and copies a
compact [4, w] block table to the host staging's front, then into block_tables[:4, :w] on the
device (a long context's W is large; a step copies only what its tables use).

Padding: a step replayed as a CUDA graph of batch G > B writes rows [B, G) as padding — token
0 at position 0, its K/V written to and read from the KV pool's padding block (never a
sequence's), one query and one KV position each — and copies G rows.

Pending inputs: with asynchronous scheduling a decode may read a token the previous step is
still sampling. Its input row is written as 0 and listed in `pending_inputs` as (row, the
previous step's sample row); after the copy, the device fills it from that step's ids.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loramux.engine.model.llama import LoraApplier, StepContext
from loramux.engine.sampler import SampledTokens, SamplingBatch, SamplingBuffers
from loramux.engine.scheduler import ScheduledChunk, sample_rows
from loramux.engine.sequence import Sequence as EngineSequence
from loramux.kernels.paged_attention import AttentionMetadata


class StagedTensor:
    """A fixed-capacity tensor written on the host (`host`, pinned when the device is CUDA, with
    `array` its numpy view) and copied to the device one prefix at a time."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.device = torch.zeros_like(self.host, device=device) if on_cuda else self.host
        self.array = self.host.numpy()

    def to_device(self, n: int) -> torch.Tensor:
        """The device view of the first `n` rows, after an asynchronous copy of them."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs: device views into `StepBuffers`, valid until its next fill."""

    chunks: list[ScheduledChunk]
    """The step's chunks in the order they run (grouped by adapter)."""
    input_ids: torch.Tensor
    context: StepContext
    logits_indices: torch.Tensor
    """Row of the final token of each chunk that samples, in chunk order (`sample_rows`: once
    more for each choice forked from it)."""
    sampling: SamplingBatch
    """How each of those rows samples."""
    graph_batch: int | None
    """The CUDA graph batch the step is padded to (rows past its chunks are padding); None:
    it runs eagerly, unpadded."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose device work is queued: its chunks in run order and its sampled tokens (on
    the device, and on their way to the host)."""

    chunks: list[ScheduledChunk]
    sampled: SampledTokens

    @functools.cached_property
    def _sample_rows(self) -> dict[EngineSequence, int]:
        return {c.seq: row for row, c in enumerate(sample_rows(self.chunks))}

    def sample_row(self, seq: EngineSequence) -> int:
        """The row of `sampled` holding the token `seq` samples in this step."""
        return self._sample_rows[seq]


class StepBuffers:
    """The preallocated per-step tensors of one runner (see the module docstring).

    A fill may begin while the device still copies the previous step's inputs (the host runs
    ahead of the device): it first waits for those copies, so staging is never overwritten
    before it was read.
    """

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        vocab_size: int,
        padding_block: int,
        device: torch.device,
    ):
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.padding_block = padding_block
        self.vocab_size = vocab_size
        self.device = device
        self.input_ids = StagedTensor((max_tokens,), torch.int64, device)
        self.positions = StagedTensor((max_tokens,), torch.int64, device)
        self.slot_mapping = StagedTensor((max_tokens,), torch.int64, device)
        self.logits_indices = StagedTensor((max_seqs,), torch.int64, device)
        self.cu_seqlens_q = StagedTensor((max_seqs + 1,), torch.int32, device)
        self.seq_lens = StagedTensor((max_seqs,), torch.int32, device)
        self.block_table_staging = StagedTensor(
            (max_seqs * max_blocks_per_seq,), torch.int32, device
        )
        self.block_tables = torch.zeros(
            max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.pending_inputs = StagedTensor((max_seqs, 2), torch.int64, device)
        self.sampling = SamplingBuffers(max_seqs, device)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def fill(
        self,
        chunks: list[ScheduledChunk],
        block_size: int,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoraApplier | None,
        previous: LaunchedStep | None,
        pad_to: int | None = None,
    ) -> StepInputs:
        """Write the step's chunks (in run order) into the buffers and copy them to the device;
        pending inputs come from `previous`, the step before (still running, maybe). `pad_to`:
        the batch of the CUDA graph it replays, for a step whose chunks are one token each."""
        assert len(chunks) <= self.max_seqs, "more chunks than sequences in a step"
        if self._copied is not None:
            self._copied.synchronize()
        num_tokens, num_samples, pending = self._write_tokens(chunks, block_size, previous)
        batch = len(chunks)
        if pad_to is not None:
            assert num_tokens == batch <= pad_to, "only one-token chunks replay a graph"
            self._write_padding(batch, pad_to, block_size)
            num_tokens = batch = pad_to
        context = StepContext(
            positions=self.positions.to_device(num_tokens),
            slot_mapping=self.slot_mapping.to_device(num_tokens),
            attention=self._attention(chunks, batch),
            kv_caches=kv_caches,
            lora=lora,
        )
        input_ids = self.input_ids.to_device(num_tokens)
        if pending:
            assert previous is not None
            self._fill_pending(input_ids, pending, previous)
        inputs = StepInputs(
            chunks=chunks,
            input_ids=input_ids,
            context=context,
            logits_indices=self.logits_indices.to_device(num_samples),
            sampling=self._sampling(chunks, previous),
            graph_batch=pad_to,
        )
        if self._copied is not None:
            self._copied.record()
        return inputs

    def _sampling(
        self, chunks: list[ScheduledChunk], previous: LaunchedStep | None
    ) -> SamplingBatch:
        """How each sampling row samples; a row whose last token is still pending (its value
        on the device) has it read from `previous` for its penalties."""
        rows = sample_rows(chunks)
        pending: dict[int, torch.Tensor] = {}
        for i, row in enumerate(rows):
            if len(row.seq.token_ids) < row.end and row.seq.params.penalizes:
                assert previous is not None
                pending[i] = previous.sampled.ids[previous.sample_row(row.seq)].clamp_min(0)
        return self.sampling.fill(rows, self.vocab_size, pending)

    def _attention(self, chunks: list[ScheduledChunk], batch: int) -> AttentionMetadata:
        """The attention metadata of `batch` rows: the chunks', then padding rows."""
        width = self._write_block_tables([c.seq.block_table for c in chunks])
        padding = (1,) * (batch - len(chunks))
        return AttentionMetadata(
            block_tables=self._copy_block_tables(len(chunks), batch, width),
            cu_seqlens_q=self.cu_seqlens_q.to_device(batch + 1),
            seq_lens=self.seq_lens.to_device(batch),
            q_lens=tuple(c.num_tokens for c in chunks) + padding,
            seq_lens_host=tuple(c.end for c in chunks) + padding,
        )

    def _fill_pending(
        self, input_ids: torch.Tensor, pending: list[tuple[int, int]], previous: LaunchedStep
    ) -> None:
        """On the device, copy each pending input's token from the previous step's ids."""
        self.pending_inputs.array[: len(pending)] = pending
        rows = self.pending_inputs.to_device(len(pending))
        # A row whose logits were not finite has no token; its request fails, so any id does.
        input_ids[rows[:, 0]] = previous.sampled.ids[rows[:, 1]].clamp_min(0)

    def _write_tokens(
        self, chunks: list[ScheduledChunk], block_size: int, previous: LaunchedStep | None
    ) -> tuple[int, int, list[tuple[int, int]]]:
        """Token ids, positions, KV slots, query offsets and KV lengths of every chunk; returns
        the step's token count, how many chunks sample, and the pending inputs."""
        ids, positions, slots = self.input_ids.array, self.positions.array, self.slot_mapping.array
        cu, seq_lens = self.cu_seqlens_q.array, self.seq_lens.array
        num_tokens = num_samples = 0
        pending: list[tuple[int, int]] = []
        cu[0] = 0
        for i, chunk in enumerate(chunks):
            seq, start, end = chunk.seq, chunk.start, chunk.end
            rows = slice(num_tokens, num_tokens + chunk.num_tokens)
            assert rows.stop <= self.max_tokens, "more tokens than the step's token budget"
            landed = min(end, len(seq.token_ids))
            ids[rows.start : rows.start + landed - start] = seq.token_ids[start:landed]
            if landed < end:
                assert end == landed + 1 and previous is not None, "a token pending too long"
                pending.append((rows.stop - 1, previous.sample_row(seq)))
            pos = np.arange(start, end)
            positions[rows] = pos
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots[rows] = table[pos // block_size] * block_size + pos % block_size
            num_tokens = rows.stop
            cu[i + 1] = num_tokens
            seq_lens[i] = end
            if chunk.samples:
                for _ in range(1 + len(chunk.forks)):
                    self.logits_indices.array[num_samples] = num_tokens - 1
                    num_samples += 1
        return num_tokens, num_samples, pending

    def _write_padding(self, start: int, end: int, block_size: int) -> None:
        """Rows [start, end) as padding rows (see the module docstring)."""
        rows = slice(start, end)
        self.input_ids.array[rows] = 0
        self.positions.array[rows] = 0
        self.slot_mapping.array[rows] = self.padding_block * block_size
        self.cu_seqlens_q.array[start + 1 : end + 1] = np.arange(start + 1, end + 1)
        self.seq_lens.array[rows] = 1

    def _write_block_tables(self, tables: Sequence[list[int]]) -> int:
        """Pack the tables as rows of the step's longest one into the staging's front."""
        width = max((len(t) for t in tables), default=0)
        staging = self.block_table_staging.array
        for i, table in enumerate(tables):
            staging[i * width : i * width + len(table)] = table
        return width

    def _copy_block_tables(self, num_seqs: int, batch: int, width: int) -> torch.Tensor:
        """Rows [:batch] of the device's block tables, their first `width` entries the step's
        (entries past a table's end hold earlier steps' blocks: any valid index will do);
        padding rows [num_seqs, batch) start with the padding block."""
        packed = self.block_table_staging.to_device(num_seqs * width).view(num_seqs, width)
        self.block_tables[:num_seqs, :width].copy_(packed)
        if batch > num_seqs:
            self.block_tables[num_seqs:batch, 0] = self.padding_block
        return self.block_tables[:batch]
