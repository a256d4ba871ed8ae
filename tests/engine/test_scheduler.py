"""Scheduling: one shared token budget, first come first served, preemption of the newest."""

from __future__ import annotations

from loramux.engine.block_manager import BlockManager
from loramux.engine.sampling import SamplingParams
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import FinishReason, Sequence


def _seq(i: int, n: int, **params: object) -> Sequence:
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    return Sequence(f"s{i}", list(range(1000 * i, 1000 * i + n)), sampling, stop_token_ids={2})


def _scheduler(num_blocks: int, block_size: int, max_num_batched_tokens: int) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size),
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=num_blocks * block_size,
    )


def _advance(sched: Scheduler, token: int = 1) -> list[tuple[str, int]]:
    """Schedule a step and land it, every sampling sequence drawing `token`."""
    out = sched.schedule()
    sched.postprocess(out.chunks, [token for c in out.chunks if c.samples])
    return [(c.seq.request_id, c.num_tokens) for c in out.chunks]


def test_decodes_and_prefill_chunks_share_one_token_budget() -> None:
    sched = _scheduler(64, 16, max_num_batched_tokens=32)
    sched.add(_seq(1, 5))
    assert _advance(sched) == [("s1", 5)]
    sched.add(_seq(2, 100))
    assert _advance(sched) == [("s1", 1), ("s2", 31)], "decode first, then a prefill chunk"
    assert _advance(sched) == [("s1", 1), ("s2", 31)]


def test_waiting_head_is_never_skipped() -> None:
    sched = _scheduler(8, 16, max_num_batched_tokens=512)
    sched.add(_seq(1, 100))  # 7 blocks
    sched.add(_seq(2, 40))  # needs 3: does not fit beside s1
    sched.add(_seq(3, 5))  # would fit, but must not jump the queue
    assert [r for r, _ in _advance(sched)] == ["s1"]
    assert [s.request_id for s in sched.waiting] == ["s2", "s3"]


def test_newest_running_sequence_is_preempted_when_blocks_run_out() -> None:
    sched = _scheduler(4, 4, max_num_batched_tokens=64)
    sched.add(_seq(1, 8))
    sched.add(_seq(2, 8))
    _advance(sched)  # both admitted with 2 full blocks each: the pool is full
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["s2"]
    assert [c.seq.request_id for c in out.chunks] == ["s1"]
    assert sched.waiting[0].request_id == "s2" and sched.waiting[0].num_computed_tokens == 0


def test_a_sequence_readmitted_after_a_preemption_counts_no_cache_hit_for_its_own_blocks() -> None:
    """s2 is preempted mid-prefill with one full block computed; readmitted, it finds that block
    in the prefix cache, but no request sent its prompt before: nothing was cached for it."""
    sched = _scheduler(4, 4, max_num_batched_tokens=8)
    s1, s2 = _seq(1, 4, max_tokens=2), _seq(2, 12)
    sched.add(s1)
    sched.add(s2)
    assert _advance(sched) == [("s1", 4), ("s2", 4)], "s2's first block is computed"
    assert _advance(sched) == [("s1", 1)], "s2 needs 2 more blocks, 1 is free: preempted"
    assert s1.is_finished and sched.stats.preemptions == 1
    assert _advance(sched) == [("s2", 8)], "readmitted, its first block from the cache"
    assert s2.num_cached_tokens == 0
    assert (sched.stats.prefix_cache_hit_tokens, sched.stats.prefix_cache_query_tokens) == (0, 16)


def test_postprocess_appends_tokens_and_finishes_on_stop_tokens_and_lengths() -> None:
    sched = _scheduler(16, 4, max_num_batched_tokens=64)
    stops, short, long = _seq(1, 3), _seq(2, 3, max_tokens=2), _seq(3, 3)
    for seq in (stops, short, long):
        sched.add(seq)
    out = sched.schedule()
    updates = sched.postprocess(out.chunks, [7, 7, 7])
    assert [(u.token, u.finish) for u in updates] == [(7, None)] * 3
    out = sched.schedule()
    updates = sched.postprocess(out.chunks, [2, 7, 7])  # 2 is a stop token
    assert [u.finish for u in updates] == [FinishReason.STOP, FinishReason.LENGTH, None]
    assert stops.is_finished and short.is_finished and sched.running == [long]
    assert stops.token_ids[-2:] == [7, 2] and stops.num_completion_tokens == 2
    assert sched.block_manager.num_free_blocks == 16 - len(long.block_table)


def test_non_finite_logits_finish_the_sequence_without_publishing_its_blocks() -> None:
    sched = _scheduler(16, 4, max_num_batched_tokens=64)
    bad, good = _seq(1, 8), _seq(2, 8)
    sched.add(bad)
    sched.add(good)
    out = sched.schedule()
    updates = sched.postprocess(out.chunks, [None, 5])
    assert [(u.seq, u.token, u.finish) for u in updates] == [
        (bad, None, FinishReason.ERROR),
        (good, 5, None),
    ]
    assert bad.is_finished and sched.running == [good]
    assert sched.block_manager.match_prefix(_seq(1, 9)).num_tokens == 0
    assert sched.block_manager.match_prefix(_seq(2, 9)).num_tokens == 8


def test_a_sequence_aborted_while_its_step_ran_is_left_alone() -> None:
    sched = _scheduler(16, 4, max_num_batched_tokens=64)
    seq = _seq(1, 5)
    sched.add(seq)
    out = sched.schedule()
    sched.finish(seq)
    assert sched.postprocess(out.chunks, [7]) == []
    assert seq.token_ids == list(range(1000, 1005)) and sched.block_manager.num_free_blocks == 16
