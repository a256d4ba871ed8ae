"""Asynchronous scheduling: step N + 1 is scheduled and prepared before step N is postprocessed,
and what every request receives is exactly what the synchronous loop gives it.

On the CPU the overlapped code path runs without any actual overlap (the device is synchronous),
so these tests check its bookkeeping: pending tokens filled from the previous step, sequences
that end while their next step is queued, preemption, aborts and failures in between.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import FinishReason
from tests.engine.conftest import make_engine


def _workload(adapters: list[str]) -> list[tuple[int, EngineRequest]]:
    """(step it arrives at, request): greedy and seeded, on the base model and on adapters, with
    EOS, stop token ids, short and long outputs, and prompts sharing prefixes."""
    shared = [(37 * i) % 4000 + 10 for i in range(48)]
    out: list[tuple[int, EngineRequest]] = []
    for i in range(14):
        params = SamplingParams(
            max_tokens=3 + (i * 5) % 17,
            temperature=0.0 if i % 3 else 0.9,
            top_p=0.9 if i % 2 else 1.0,
            seed=None if i % 3 else 100 + i,
            stop_token_ids=(17, 42) if i % 4 == 1 else (),
            ignore_eos=i % 5 == 0,
        )
        prompt = shared[: 8 + 5 * i] + [500 + i] * (i % 4 + 1)
        adapter = adapters[i % len(adapters)] if i % 2 and adapters else None
        out.append(
            (i // 3, EngineRequest(f"r{i}", params, prompt_token_ids=prompt, adapter=adapter))
        )
    return out


def _run(engine: LLMEngine, workload: list[tuple[int, EngineRequest]]) -> dict[str, Any]:
    """Step until idle, adding each request at its step; every request's tokens, finish
    reason and token counts. (Prefix-cache hits are left out: when a block is published
    depends on when its step is postprocessed, which is what overlapping changes.)"""
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for _, r in workload}
    pending = sorted(workload, key=lambda item: item[0])
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        for out in engine.step():
            outputs[out.request_id].append(out)
        step += 1
    return {
        rid: (
            [t for o in outs for t in o.token_ids],
            outs[-1].finish_reason,
            (outs[-1].usage.prompt_tokens, outs[-1].usage.completion_tokens)
            if outs[-1].usage
            else None,
        )
        for rid, outs in outputs.items()
    }


def _engines(model_dir: Path, **settings: Any) -> tuple[LLMEngine, LLMEngine]:
    return (
        make_engine(model_dir, async_scheduling=False, **settings),
        make_engine(model_dir, async_scheduling=True, **settings),
    )


def _same_results(
    model_dir: Path, adapter_dirs: list[Path], **settings: Any
) -> tuple[LLMEngine, LLMEngine]:
    sync, overlapped = _engines(model_dir, **settings)
    digests = [[e.register_adapter(d) for d in adapter_dirs] for e in (sync, overlapped)]
    expected = _run(sync, _workload(digests[0]))
    assert _run(overlapped, _workload(digests[1])) == expected
    for engine in (sync, overlapped):
        assert engine.stats().kv_blocks_used == 0
        assert engine.lora is None or all(slot.pins == 0 for slot in engine.lora.slots)
    return sync, overlapped


def test_overlapped_steps_give_every_request_what_the_synchronous_loop_gives(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    sync, overlapped = _same_results(
        demo_model_dir, demo_adapter_dirs[:3], max_num_batched_tokens=64, max_loras=4
    )
    assert (
        sync.stats().prefix_cache_hit_tokens > 0 and overlapped.stats().prefix_cache_hit_tokens > 0
    )


def test_overlapped_steps_survive_preemption_and_length_limits(demo_model_dir: Path) -> None:
    sync, overlapped = _same_results(
        demo_model_dir, [], num_kv_blocks=12, max_model_len=96, max_num_batched_tokens=48
    )
    assert sync.stats().preemptions > 0 and overlapped.stats().preemptions > 0


def test_a_request_aborted_while_its_next_step_is_queued_frees_everything(
    demo_model_dir: Path,
) -> None:
    engine = make_engine(demo_model_dir, async_scheduling=True)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request(EngineRequest("kept", params, prompt_token_ids=list(range(10, 40))))
    engine.add_request(EngineRequest("gone", params, prompt_token_ids=list(range(50, 70))))
    assert engine.step() == [], "the first step is still in flight"
    first = engine.step()
    assert {o.request_id for o in first} == {"kept", "gone"}
    final = engine.abort("gone")
    assert final is not None and final.finish_reason is FinishReason.ABORT
    outputs = [o for _ in range(3) for o in engine.step()]
    assert {o.request_id for o in outputs} == {"kept"}
    while engine.has_work:
        engine.step()
    assert engine.stats().kv_blocks_used == 0


def test_non_finite_logits_fail_only_their_request_with_steps_in_flight(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], overflowing_adapter: Path
) -> None:
    engine = make_engine(demo_model_dir, async_scheduling=True, max_loras=4)
    good = engine.register_adapter(demo_adapter_dirs[0])
    bad = engine.register_adapter(overflowing_adapter)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    requests = [
        EngineRequest("good", params, prompt_token_ids=list(range(20, 45)), adapter=good),
        EngineRequest("bad", params, prompt_token_ids=list(range(60, 90)), adapter=bad),
        EngineRequest("base", params, prompt_token_ids=list(range(100, 120))),
    ]
    results = _run(engine, [(0, r) for r in requests])
    assert results["bad"][1] is FinishReason.ERROR
    assert [results[r][1] for r in ("good", "base")] == ["length", "length"]
    assert all(len(results[r][0]) == 6 for r in ("good", "base"))
    assert engine.stats().kv_blocks_used == 0


def _same_schedule_workload(adapters: list[str]) -> list[tuple[int, EngineRequest]]:
    """Twelve requests at step 0 on the base model and three adapters, greedy and seeded, with
    chunked prefills and lengths known in advance (no EOS, stop ids or shared prefixes): the
    synchronous and the overlapped loop schedule exactly the same steps."""
    out = []
    for i in range(12):
        params = SamplingParams(
            max_tokens=3 + (i * 7) % 23,
            temperature=0.0 if i % 3 else 0.9,
            top_p=0.9 if i % 2 else 1.0,
            seed=100 + i,
            ignore_eos=True,
        )
        prompt = [(97 * i + 13 * k) % 4000 + 10 for k in range(9 + 4 * i)]
        adapter = adapters[i % len(adapters)] if i % 2 else None
        out.append((0, EngineRequest(f"r{i}", params, prompt_token_ids=prompt, adapter=adapter)))
    return out


def _schedule_log(engine: LLMEngine) -> list[tuple[tuple[str, int], ...]]:
    """Records the (request, tokens) chunks of every step the engine prepares."""
    log: list[tuple[tuple[str, int], ...]] = []
    prepare = engine.runner.prepare

    def recording(chunks: Any, *args: Any, **kwargs: Any) -> Any:
        log.append(tuple(sorted((c.seq.request_id, c.num_tokens) for c in chunks)))
        return prepare(chunks, *args, **kwargs)

    engine.runner.prepare = recording  # type: ignore[method-assign]
    return log


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlapped_steps_equal_the_synchronous_loop_step_for_step(
    device: str, demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    """On a GPU the kernels are not batch-invariant (cuBLAS picks its kernel by shape, Triton's
    fp32 dots are tf32 with tiles sized by the step), so a token computed in another batch can
    round differently and flip a near-tie of the random demo model. The comparison therefore
    runs a workload both loops schedule identically (checked), and the overlapped loop must give
    every request exactly the tokens of the synchronous one: its pending tokens read from the
    previous step's sampled ids on the device, seeded sampling and adapters included."""
    settings = {"device": device, "max_model_len": 128, "max_num_batched_tokens": 64}
    sync, overlapped = _engines(demo_model_dir, max_loras=4, **settings)
    results, schedules = [], []
    for engine in (sync, overlapped):
        digests = [engine.register_adapter(d) for d in demo_adapter_dirs[:3]]
        schedules.append(_schedule_log(engine))
        results.append(_run(engine, _same_schedule_workload(digests)))
        assert engine.stats().kv_blocks_used == 0 and engine.stats().preemptions == 0
        assert engine.lora is not None and all(slot.pins == 0 for slot in engine.lora.slots)
    assert schedules[0] == schedules[1] and len(schedules[0]) > 20
    assert results[1] == results[0]
