"""Scheduling: one shared token budget, first come first served, preemption of the newest."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def _seq(i: int, n: int) -> Sequence:
    return Sequence(f"s{i}", list(range(1000 * i, 1000 * i + n)), SamplingParams(), i)


def _advance(sched: Scheduler) -> list[tuple[str, int]]:
    out = sched.schedule()
    for c in out.chunks:
        c.seq.num_computed_tokens += c.num_tokens
        if c.samples:
            c.seq.token_ids.append(1)
    return [(c.seq.request_id, c.num_tokens) for c in out.chunks]


def test_decodes_and_prefill_chunks_share_one_token_budget() -> None:
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=32)
    sched.add(_seq(1, 5))
    assert _advance(sched) == [("s1", 5)]
    sched.add(_seq(2, 100))
    assert _advance(sched) == [("s1", 1), ("s2", 31)], "decode first, then a prefill chunk"
    assert _advance(sched) == [("s1", 1), ("s2", 31)]


def test_waiting_head_is_never_skipped() -> None:
    sched = Scheduler(BlockManager(8, 16), max_num_seqs=8, max_num_batched_tokens=512)
    sched.add(_seq(1, 100))  # 7 blocks
    sched.add(_seq(2, 40))  # needs 3: does not fit beside s1
    sched.add(_seq(3, 5))  # would fit, but must not jump the queue
    assert [r for r, _ in _advance(sched)] == ["s1"]
    assert [s.request_id for s in sched.waiting] == ["s2", "s3"]


def test_newest_running_sequence_is_preempted_when_blocks_run_out() -> None:
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(_seq(1, 8))
    sched.add(_seq(2, 8))
    _advance(sched)  # both admitted with 2 full blocks each: the pool is full
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["s2"]
    assert [c.seq.request_id for c in out.chunks] == ["s1"]
    assert sched.waiting[0].request_id == "s2" and sched.waiting[0].num_computed_tokens == 0
