"""n > 1: one request, n choices. The prompt is computed once and its KV blocks shared; each
choice is exactly what a request of its own with the choice's seed gives, in any batch, under
preemption and with asynchronous scheduling; usage counts the prompt once; no block leaks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from loramux.engine.errors import InvalidRequestError
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams, choice_seed
from loramux.engine.sequence import FinishReason
from tests.engine.conftest import make_engine, run_to_completion

BLOCK = 16


def _prompt(i: int, length: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 4096) for _ in range(length)]


def _choices(outputs: list[RequestOutput]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for out in outputs:
        tokens.setdefault(out.index, []).extend(out.token_ids)
    return tokens


def _solo(engine: Any, request: EngineRequest) -> dict[int, list[int]]:
    """Each choice of `request` run as a request of its own, with the choice's seed."""
    params = request.params
    solo = [
        EngineRequest(
            f"{request.request_id}/{i}",
            SamplingParams(
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=choice_seed(params.seed, i),
                ignore_eos=params.ignore_eos,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                logit_bias=params.logit_bias,
            ),
            prompt_token_ids=request.prompt_token_ids,
            adapter=request.adapter,
        )
        for i in range(params.n)
    ]
    outputs = run_to_completion(engine, solo)
    return {i: _choices(outputs[r.request_id])[0] for i, r in enumerate(solo)}


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Any:
    return make_engine(demo_model_dir, enable_prefix_caching=False)


def test_four_choices_compute_the_prompt_once_and_count_it_once(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, enable_prefix_caching=False)
    prompt = _prompt(1, 3 * BLOCK + 5)  # a partial last block: copied on write
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, n=4)
    engine.add_request(EngineRequest("four", params, prompt_token_ids=prompt))
    first = engine.step()
    stats = engine.stats()
    assert stats.prompt_tokens_computed == len(prompt)
    assert stats.kv_blocks_used == 4, "the choices share the prompt's 4 blocks"
    assert sorted(o.index for o in first) == [0, 1, 2, 3]
    outputs = list(first)
    while engine.has_work:
        outputs += engine.step()
    stats = engine.stats()
    assert stats.prompt_tokens_computed == len(prompt), "no prompt token computed twice"
    assert stats.kv_blocks_used == 0
    choices = _choices(outputs)
    assert sorted(choices) == [0, 1, 2, 3] and all(len(t) == 6 for t in choices.values())
    assert len({tuple(t) for t in choices.values()}) == 4, "seeded choices differ"
    last = outputs[-1]
    assert [o for o in outputs if o.usage is not None] == [last] and last.is_last
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 24)
    assert sum(o.finished for o in outputs) == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_choice_equals_its_own_request_in_a_mixed_batch(
    demo_model_dir: Path, reference: Any, async_scheduling: bool
) -> None:
    engine = make_engine(demo_model_dir, async_scheduling=async_scheduling)
    requests = [
        EngineRequest(
            "sampled",
            SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=3, ignore_eos=True),
            prompt_token_ids=_prompt(2, 2 * BLOCK),  # a whole last block: nothing to copy
        ),
        EngineRequest(
            "penalized",
            SamplingParams(
                max_tokens=8,
                temperature=0.8,
                seed=-1,
                n=2,
                presence_penalty=-2.0,
                frequency_penalty=-2.0,
                logit_bias=((9, 10.0),),
                ignore_eos=True,
            ),
            prompt_token_ids=_prompt(3, 21),
        ),
        EngineRequest(
            "greedy",
            SamplingParams(max_tokens=8, n=3, ignore_eos=True),
            prompt_token_ids=_prompt(4, 9),
        ),
        EngineRequest("single", SamplingParams(max_tokens=8), prompt_token_ids=_prompt(5, 30)),
    ]
    outputs = run_to_completion(engine, requests)
    for r in requests:
        assert _choices(outputs[r.request_id]) == _solo(reference, r), r.request_id
    assert len(set(map(tuple, _choices(outputs["greedy"]).values()))) == 1
    assert engine.stats().kv_blocks_used == 0


def test_choices_stay_exact_when_chunked_preempted_and_recomputed(
    demo_model_dir: Path, reference: Any
) -> None:
    engine = make_engine(
        demo_model_dir, num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=24
    )
    requests = [
        EngineRequest(
            f"r{i}",
            SamplingParams(max_tokens=20, temperature=1.0, seed=i, n=3, ignore_eos=True),
            prompt_token_ids=_prompt(10 + i, 20 + 7 * i),
        )
        for i in range(3)
    ]
    outputs = run_to_completion(engine, requests)
    assert engine.stats().preemptions > 0, "the pool was meant to force preemption"
    assert engine.stats().kv_blocks_used == 0
    for r in requests:
        assert _choices(outputs[r.request_id]) == _solo(reference, r), r.request_id


@pytest.mark.parametrize("steps_before", [0, 1, 3])
def test_abort_ends_every_choice_and_frees_every_block(
    demo_model_dir: Path, steps_before: int
) -> None:
    engine = make_engine(demo_model_dir, async_scheduling=steps_before == 3)
    params = SamplingParams(max_tokens=50, temperature=1.0, n=4, ignore_eos=True)
    engine.add_request(EngineRequest("gone", params, prompt_token_ids=_prompt(6, 37)))
    engine.add_request(EngineRequest("kept", SamplingParams(max_tokens=5), prompt_token_ids=[5]))
    for _ in range(steps_before):
        engine.step()
    final = engine.abort("gone")
    assert final is not None and final.finish_reason is FinishReason.ABORT and final.is_last
    assert engine.abort("gone") is None
    later: list[RequestOutput] = []
    while engine.has_work:
        later += engine.step()
    assert {o.request_id for o in later} <= {"kept"}
    assert engine.stats().kv_blocks_used == 0


def test_bad_choice_counts_and_biases_are_refused_and_others_go_on(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, max_num_seqs=4)
    bad = [
        SamplingParams(n=5),  # more choices than the engine runs at once
        SamplingParams(logit_bias=((4096, 1.0),)),  # past the vocabulary
        SamplingParams(logit_bias=((2**70, 1.0),)),
    ]
    good = EngineRequest("good", SamplingParams(max_tokens=4, n=2), prompt_token_ids=[1, 2])
    engine.add_request(good)
    for i, params in enumerate(bad):
        with pytest.raises(InvalidRequestError) as refused:
            engine.add_request(EngineRequest(f"bad{i}", params, prompt_token_ids=[1, 2]))
        assert ("n must" in str(refused.value)) or ("logit_bias" in str(refused.value))
        assert len(str(refused.value)) < 200
    outputs: list[RequestOutput] = []
    while engine.has_work:
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"good"} and outputs[-1].is_last
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_choice_aborted_alone_ends_while_the_others_go_on_unchanged(
    demo_model_dir: Path, reference: Any, async_scheduling: bool
) -> None:
    """A stop string ends choice 1 at the gateway, which aborts it alone: its sequence ends
    (final output ABORT, not the request's last), the other choices generate exactly what they
    generate in a request never aborted, and every block is freed at the end. The request is
    not counted as aborted."""
    engine = make_engine(demo_model_dir, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3, ignore_eos=True)
    request = EngineRequest("split", params, prompt_token_ids=_prompt(3, 21))
    engine.add_request(request)
    outputs: list[RequestOutput] = []
    while not any(o.index == 1 and o.token_ids for o in outputs):
        outputs += engine.step()
    final = engine.abort("split", choice=1)
    assert final is not None and final.index == 1 and final.finish_reason is FinishReason.ABORT
    assert not final.is_last
    assert engine.abort("split", choice=1) is None
    while engine.has_work:
        outputs += engine.step()
    assert all(o.index != 1 for o in outputs if o.finish_reason is FinishReason.LENGTH)
    assert outputs[-1].is_last and outputs[-1].usage is not None
    solo = _solo(reference, request)
    got = _choices([*outputs, final])
    assert (got[0], got[2]) == (solo[0], solo[2])
    assert got[1] == solo[1][: len(got[1])] and len(got[1]) < len(solo[1])
    assert engine.stats().kv_blocks_used == 0
    assert engine.stats().aborted == 0


def _abort_before_the_fork(
    model_dir: Path, choice: int, steps_before: int
) -> tuple[Any, EngineRequest, RequestOutput | None, list[RequestOutput]]:
    """A request for 3 choices whose 37-token prompt takes 3 chunked steps, and choice `choice`
    aborted alone after `steps_before` of them (before the fork): the engine, the request, the
    abort's output and the outputs of those steps."""
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True)
    request = EngineRequest("r", params, prompt_token_ids=_prompt(8, 37))
    engine.add_request(request)
    outputs: list[RequestOutput] = []
    for _ in range(steps_before):
        outputs += engine.step()
    return engine, request, engine.abort("r", choice=choice), outputs


@pytest.mark.parametrize("steps_before", [0, 1])
def test_choice_0_aborted_before_the_fork_leaves_the_others_to_fork_from_the_prompt(
    demo_model_dir: Path, reference: Any, steps_before: int
) -> None:
    """Bug: choice 0 aborted alone while still queued (or mid-way through a chunked prefill)
    took the other choices with it, since its `forks` were the only place they were scheduled
    from: they never ran nor ended, and the request's stream waited forever. Now choice 1
    computes the prompt in its place and forks choice 2; both generate exactly what they
    would in a request never aborted, and every block is freed."""
    engine, request, final, outputs = _abort_before_the_fork(demo_model_dir, 0, steps_before)
    assert final is not None and final.finish_reason is FinishReason.ABORT and not final.is_last
    while engine.has_work:
        outputs += engine.step()
    ended = {o.index: o.finish_reason for o in outputs if o.finish_reason is not None}
    assert ended == {1: FinishReason.LENGTH, 2: FinishReason.LENGTH}
    assert outputs[-1].is_last and outputs[-1].usage is not None
    solo = _solo(reference, request)
    got = _choices(outputs)
    assert (got[1], got[2]) == (solo[1], solo[2])
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_choice_aborted_before_the_fork_is_never_forked(
    demo_model_dir: Path, reference: Any, steps_before: int
) -> None:
    """Bug: choice 1 aborted alone before the fork stayed in choice 0's `forks`, was forked
    back to running and generated max_tokens tokens nobody received, holding blocks and a
    seat. Now it never runs: only the other choices' tokens are generated, and they are
    exactly what they would be in a request never aborted."""
    engine, request, final, outputs = _abort_before_the_fork(demo_model_dir, 1, steps_before)
    assert final is not None and final.finish_reason is FinishReason.ABORT
    while engine.has_work:
        outputs += engine.step()
    assert engine.stats().generated_tokens == 2 * request.params.max_tokens
    got = _choices(outputs)
    solo = _solo(reference, request)
    assert set(got) == {0, 2} and (got[0], got[2]) == (solo[0], solo[2])
    assert engine.stats().kv_blocks_used == 0


def test_a_choice_aborted_before_the_fork_pins_no_adapter(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    """Bug: the choice forked after its abort pinned its adapter's slot although its user had
    been counted out, so retiring the adapter once the request ended made the next step vacate
    a pinned slot and raise, stopping the engine for every tenant. Now the adapter is dropped
    and the engine goes on."""
    engine = make_engine(demo_model_dir)
    digest = engine.register_adapter(demo_adapter_dirs[0])
    params = SamplingParams(max_tokens=50, n=2, ignore_eos=True)
    engine.add_request(EngineRequest("r", params, prompt_token_ids=_prompt(10, 35), adapter=digest))
    engine.add_request(
        EngineRequest("other", SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=[5])
    )
    engine.abort("r", choice=1)
    while not any(s.index == 0 for s in engine.scheduler.running):
        engine.step()
    engine.abort("r")
    engine.retire_adapter(digest)
    outputs: list[RequestOutput] = []
    while engine.has_work:
        outputs += engine.step()
    assert any(o.request_id == "other" and o.is_last for o in outputs)
    assert engine.lora is not None and digest not in engine.lora.resident()
    assert engine.stats().kv_blocks_used == 0
