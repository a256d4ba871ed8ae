"""Step inputs: written into buffers allocated once, each step a prefix of them."""

from __future__ import annotations

import torch

from loramux.engine.sampler import SampledTokens
from loramux.engine.sampling import SamplingParams
from loramux.engine.scheduler import ScheduledChunk
from loramux.engine.sequence import Sequence
from loramux.engine.step_inputs import LaunchedStep, StepBuffers

BLOCK = 4


def _chunk(
    name: str, length: int, start: int, num_tokens: int, blocks: list[int]
) -> ScheduledChunk:
    seq = Sequence(name, list(range(100, 100 + length)), SamplingParams())
    seq.block_table = blocks
    return ScheduledChunk(seq, start, num_tokens, start + num_tokens == length)


def _buffers() -> StepBuffers:
    return StepBuffers(16, 4, 8, vocab_size=200, padding_block=99, device=torch.device("cpu"))


def _fill(buffers: StepBuffers, chunks: list[ScheduledChunk]):  # type: ignore[no-untyped-def]
    return buffers.fill(chunks, BLOCK, kv_caches=[], lora=None, previous=None)


def test_a_step_is_written_as_flat_tokens_with_their_positions_slots_and_tables() -> None:
    buffers = _buffers()
    decode = _chunk("decode", 6, 5, 1, [7, 3])  # position 5: block 3, offset 1
    prefill = _chunk("prefill", 10, 4, 3, [1, 2, 9])  # positions 4-6 of 10: no sample
    inputs = _fill(buffers, [decode, prefill])
    assert inputs.input_ids.tolist() == [105, 104, 105, 106]
    assert inputs.context.positions.tolist() == [5, 4, 5, 6]
    assert inputs.context.slot_mapping.tolist() == [3 * 4 + 1, 2 * 4, 2 * 4 + 1, 2 * 4 + 2]
    assert inputs.logits_indices.tolist() == [0]
    meta = inputs.context.attention
    assert meta.cu_seqlens_q.tolist() == [0, 1, 4] and meta.seq_lens.tolist() == [6, 7]
    assert (meta.q_lens, meta.seq_lens_host) == ((1, 3), (6, 7))
    assert meta.block_tables[0, :2].tolist() == [7, 3] and meta.block_tables[1, :3].tolist() == [
        1,
        2,
        9,
    ]


def test_every_step_reuses_the_same_storage() -> None:
    buffers = _buffers()
    first = _fill(buffers, [_chunk("a", 9, 0, 9, [4, 5, 6])])
    pointers = (
        first.input_ids.data_ptr(),
        first.context.positions.data_ptr(),
        first.context.slot_mapping.data_ptr(),
        first.context.attention.block_tables.data_ptr(),
    )
    second = _fill(buffers, [_chunk("b", 3, 2, 1, [8]), _chunk("c", 13, 12, 1, [0, 1, 2, 3])])
    assert pointers == (
        second.input_ids.data_ptr(),
        second.context.positions.data_ptr(),
        second.context.slot_mapping.data_ptr(),
        second.context.attention.block_tables.data_ptr(),
    )
    assert second.input_ids.tolist() == [102, 112]
    assert second.context.attention.block_tables[:, :1].tolist() == [[8], [0]]
    assert second.context.attention.block_tables[1, :4].tolist() == [0, 1, 2, 3]
    assert second.logits_indices.tolist() == [0, 1]


def test_a_token_still_being_sampled_is_filled_from_the_previous_steps_ids() -> None:
    buffers = _buffers()
    a, b = _chunk("a", 5, 4, 1, [0, 1]), _chunk("b", 7, 6, 1, [2, 3])
    previous = LaunchedStep([a, b], SampledTokens(torch.tensor([41, 42])))
    for chunk in (a, b):  # each has its token from `previous` pending: position 5, resp. 7
        chunk.seq.num_pending_tokens = 1
    b_next = ScheduledChunk(b.seq, 7, 1, True)
    a_next = ScheduledChunk(a.seq, 5, 1, True)
    inputs = buffers.fill([b_next, a_next], BLOCK, kv_caches=[], lora=None, previous=previous)
    assert inputs.input_ids.tolist() == [42, 41]
    assert inputs.context.positions.tolist() == [7, 5]


def test_padding_rows_of_a_graph_batch_touch_only_the_padding_block() -> None:
    buffers = _buffers()  # padding block 99
    chunk = _chunk("a", 6, 5, 1, [7, 3])
    inputs = buffers.fill([chunk], BLOCK, kv_caches=[], lora=None, previous=None, pad_to=4)
    assert inputs.graph_batch == 4
    assert inputs.input_ids.tolist() == [105, 0, 0, 0]
    assert inputs.context.positions.tolist() == [5, 0, 0, 0]
    assert inputs.context.slot_mapping.tolist() == [13, 99 * 4, 99 * 4, 99 * 4]
    meta = inputs.context.attention
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4] and meta.seq_lens.tolist() == [6, 1, 1, 1]
    assert meta.block_tables[1:, 0].tolist() == [99, 99, 99]
    assert inputs.logits_indices.tolist() == [0]
