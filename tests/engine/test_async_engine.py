"""The async facade: streams, aborts that free every block, seeded sampling, bad input."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import llguidance
import pytest

from loramux.engine.async_engine import COMPILE_THREADS, AsyncEngine
from loramux.engine.errors import InvalidRequestError, PromptTooLongError
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import FinishReason
from loramux.engine.structured import StructuredOutput
from tests.engine.conftest import make_engine


@pytest.fixture
async def engine(demo_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(make_engine(demo_model_dir, num_kv_blocks=128, max_num_batched_tokens=128))
    eng.start()
    yield eng
    eng.shutdown()


async def _collect(engine: AsyncEngine, request: EngineRequest) -> list[RequestOutput]:
    return [out async for out in engine.generate(request)]


async def _wait_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine never went idle: {engine.stats()}")


async def test_streamed_deltas_concatenate_and_end_with_usage(engine: AsyncEngine) -> None:
    messages = [{"role": "user", "content": "Write a haiku about paging."}]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = await _collect(engine, EngineRequest("chat", params, messages=messages))
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 20
    assert sum(len(o.token_ids) for o in outs) == 20


async def test_aborted_requests_free_every_block(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def consume(i: int, stop_after: int | None) -> int:
        seen = 0
        stream = engine.generate(
            EngineRequest(f"a{i}", params, prompt=f"def function_{i}(x):" * (i + 1))
        )
        async for _ in stream:
            seen += 1
            if stop_after is not None and seen >= stop_after:
                break  # the client went away mid-stream
        await stream.aclose()
        return seen

    tasks = [consume(i, stop_after=3 + i if i % 2 else None) for i in range(8)]
    seen = await asyncio.gather(*tasks)
    assert [s for i, s in enumerate(seen) if i % 2 == 0] == [200] * 4
    engine.abort("a-request-that-never-existed")
    await _wait_idle(engine)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total


async def _aborted_while_compiling(
    engine: AsyncEngine, request: EngineRequest, choice: int | None = None
) -> list[RequestOutput]:
    """`request`'s outputs, aborted (or only its choice `choice`) while its grammar compiles."""
    stream = engine.generate(request)
    first = asyncio.ensure_future(anext(stream))
    # One turn: generate runs to its compile on a worker thread; its request is not added
    # until this test yields again, so the abort is on the step thread's queue first.
    await asyncio.sleep(0)
    assert not first.done()
    engine.abort(request.request_id, choice)
    return [await first] + [out async for out in stream]


async def test_an_abort_while_the_grammar_compiles_stops_the_request_before_it_runs(
    engine: AsyncEngine,
) -> None:
    """A structured request's grammar compiles off the event loop before the step thread has
    the request; an abort meanwhile (its client left, or its gateway aborted it over the
    engine service) ends it before it runs, its blocks freed. The bug: the step thread found
    no such request and dropped the abort; the request then ran to its end for nobody."""
    params = SamplingParams(max_tokens=48, structured=StructuredOutput("json_object"))
    outs = await _aborted_while_compiling(engine, EngineRequest("c", params, prompt="Fill"))
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT]
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 0
    await _wait_idle(engine)
    assert engine.stats().kv_blocks_used == 0


async def test_a_choice_aborted_while_the_grammar_compiles_ends_alone(engine: AsyncEngine) -> None:
    """A choice aborted alone (a stop string matched at the gateway) before its request was
    added ends before it runs; the request's other choice runs as asked."""
    structured = StructuredOutput("json_object")
    params = SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=3, structured=structured)
    outs = await _aborted_while_compiling(engine, EngineRequest("c2", params, prompt="Hi"), 1)
    ends = {o.index: o.finish_reason for o in outs if o.finish_reason is not None}
    assert ends[1] is FinishReason.ABORT and ends[0] is not FinishReason.ABORT
    assert not any(o.token_ids for o in outs if o.index == 1)
    assert any(o.token_ids for o in outs if o.index == 0)


async def test_same_seed_same_output_alone_and_in_a_busy_batch(engine: AsyncEngine) -> None:
    params = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    prompt = "import collections\n\nclass Counter"

    def tokens(outs: list[RequestOutput]) -> list[int]:
        return [t for o in outs for t in o.token_ids]

    alone = tokens(await _collect(engine, EngineRequest("alone", params, prompt=prompt)))
    noise = [
        _collect(
            engine,
            EngineRequest(
                f"n{i}", SamplingParams(max_tokens=30, temperature=1.0), prompt=f"x{i} = " * i
            ),
        )
        for i in range(1, 12)
    ]
    busy, *_ = await asyncio.gather(
        _collect(engine, EngineRequest("busy", params, prompt=prompt)), *noise
    )
    assert tokens(busy) == alone
    other = tokens(
        await _collect(
            engine,
            EngineRequest(
                "other", SamplingParams(**{**params.__dict__, "seed": 99}), prompt=prompt
            ),
        )
    )
    assert other != alone


@pytest.mark.parametrize(
    ("request_kwargs", "error"),
    [
        ({"prompt": "x" * 10, "params": SamplingParams(max_tokens=10_000)}, PromptTooLongError),
        ({"prompt_token_ids": list(range(600))}, PromptTooLongError),
        ({"prompt": ""}, InvalidRequestError),
        ({"prompt_token_ids": []}, InvalidRequestError),
        ({"messages": []}, InvalidRequestError),
        ({"prompt_token_ids": [1, 2, 10**9]}, InvalidRequestError),
        ({}, InvalidRequestError),
        ({"prompt": "a", "prompt_token_ids": [1]}, InvalidRequestError),
    ],
)
async def test_bad_requests_are_refused_and_nothing_is_queued(
    engine: AsyncEngine, request_kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        await _collect(engine, EngineRequest("bad", **request_kwargs))  # type: ignore[arg-type]
    stats = engine.stats()
    assert stats.waiting == 0 and stats.running == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"temperature": -0.1},
        {"top_k": -1},
        {"stop": ("",)},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": -float("inf")},
        {"temperature": 10**400},
        {"temperature": "1.0"},
        {"top_p": float("nan")},
        {"top_p": float("inf")},
        {"max_tokens": -(10**5000)},
        {"top_k": -(10**5000)},
        {"max_tokens": 1.5},
        {"seed": 1.5},
        {"seed": True},
        {"stop": (5,)},
        {"stop_token_ids": ("eos",)},
    ],
)
def test_bad_sampling_parameters_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert len(str(refused.value)) < 200


async def test_a_huge_max_tokens_is_refused_with_a_short_message(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=10**5000)
    with pytest.raises(PromptTooLongError) as refused:
        await _collect(engine, EngineRequest("huge", params, prompt="hi"))
    assert "an integer of" in str(refused.value) and len(str(refused.value)) < 300


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize(
    "hostile",
    [
        {"temperature": 1e-38},
        {"temperature": 5e-324},
        {"temperature": 1e-38, "top_p": 1e-300, "top_k": 10**30},
        {"temperature": 1e300},
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 0.7, "top_p": 5e-324, "seed": 3},
        {"temperature": 0.7, "seed": 2**64 + 5},
        {"temperature": 0.7, "seed": -1},
        {"temperature": 0.7, "seed": -(10**5000)},
    ],
)
async def test_extreme_sampling_parameters_get_an_answer_and_the_engine_keeps_serving(
    engine: AsyncEngine, hostile: dict[str, object]
) -> None:
    prompt = "def tokenize(text):"
    params = SamplingParams(max_tokens=8, ignore_eos=True, **hostile)  # type: ignore[arg-type]
    outs = await _collect(engine, EngineRequest("hostile", params, prompt=prompt))
    assert outs[-1].finish_reason == "length" and len(_tokens(outs)) == 8
    after = await _collect(
        engine, EngineRequest("after", SamplingParams(max_tokens=4, ignore_eos=True), prompt="x")
    )
    assert after[-1].finish_reason == "length" and engine.running


async def test_a_temperature_below_the_floor_decodes_greedily(engine: AsyncEngine) -> None:
    prompt = "class Parser:"
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = _tokens(await _collect(engine, EngineRequest("greedy", greedy, prompt=prompt)))
    for i, temperature in enumerate([1e-38, 5e-324, 9.9e-6]):
        tiny = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=i)
        got = _tokens(await _collect(engine, EngineRequest(f"tiny-{i}", tiny, prompt=prompt)))
        assert got == expected, temperature
    # A nucleus too small for float32 keeps the most likely token alone: greedy as well.
    nucleus = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_p=1e-300)
    got = _tokens(await _collect(engine, EngineRequest("tiny-top-p", nucleus, prompt=prompt)))
    assert got == expected


async def test_seeds_are_taken_modulo_two_to_the_64(engine: AsyncEngine) -> None:
    prompt = "import os\n"

    async def sampled(request_id: str, seed: int) -> list[int]:
        params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=seed)
        return _tokens(await _collect(engine, EngineRequest(request_id, params, prompt=prompt)))

    assert await sampled("minus-one", -1) == await sampled("max", 2**64 - 1)
    assert await sampled("past", 2**64 + 5) == await sampled("five", 5)


async def test_an_idle_engine_drops_a_retired_adapter_at_once(
    engine: AsyncEngine, demo_adapter_dirs: list[Path]
) -> None:
    """A retired adapter is dropped between steps once no request uses it; an idle engine took
    no step, so it kept the adapter (and the engine service its uploaded files: a deleted
    tenant's weights) until an unrelated request came (found by attacking the engine
    service)."""
    lora = engine.engine.lora
    assert lora is not None
    digest = await engine.register_adapter(demo_adapter_dirs[3])
    dropped = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    lora.on_drop = lambda d: loop.call_soon_threadsafe(dropped.set_result, d)
    assert engine.retire_adapter(digest)
    assert await asyncio.wait_for(dropped, 10) == digest
    assert not lora.holds(digest)


async def test_compiles_take_owners_in_turn_and_hold_up_no_compiled_grammar(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Owner A's new schemas hold every compile thread (held with an event inside the grammar
    library) with more waiting. Meanwhile owner B's request whose grammar is compiled is served
    and an adapter registers; B's new schema compiles before A's last. The bug: every
    structured request, compiled or not, was checked on the loop's default executor (a few
    threads, first come first served), which adapter registrations share too: all three waited
    behind every compile of A's sent before them."""
    facade = AsyncEngine(make_engine(demo_model_dir, max_loras=2))
    facade.start()
    release, started = threading.Event(), []
    validate = llguidance.LLMatcher.validate_grammar

    def held(grammar: str, *args: Any, **kwargs: Any) -> Any:
        started.append(marker.group() if (marker := re.search(r"(held|new)-\d", grammar)) else "")
        if "held-" in grammar:
            release.wait(60)
        return validate(grammar, *args, **kwargs)

    def request(request_id: str, owner: str, structured: StructuredOutput) -> EngineRequest:
        params = SamplingParams(max_tokens=1, structured=structured)
        return EngineRequest(request_id, params, prompt_token_ids=[5, 6, 7], owner=owner)

    def const(text: str) -> StructuredOutput:
        return StructuredOutput("json_schema", json.dumps({"const": text}))

    json_object = StructuredOutput("json_object")
    try:
        await _collect(facade, request("b-warm", "b", json_object))  # compiled, cached
        monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", staticmethod(held))
        flood = COMPILE_THREADS + 4
        floods = [
            asyncio.create_task(_collect(facade, request(f"a{i}", "a", const(f"held-{i}"))))
            for i in range(flood)
        ]
        async with asyncio.timeout(60):
            while len(started) < COMPILE_THREADS:  # every compile thread is held
                await asyncio.sleep(0.01)
            outputs = await _collect(facade, request("b-compiled", "b", json_object))
            assert outputs[-1].finished and outputs[-1].error is None
            await facade.register_adapter(demo_adapter_dirs[0])
            new = asyncio.create_task(_collect(facade, request("b-new", "b", const("new-0"))))
            while facade.compiles_waiting() < flood - COMPILE_THREADS + 1:  # B's is waiting
                await asyncio.sleep(0.01)
            release.set()
            await asyncio.gather(new, *floods)
    finally:
        release.set()
        facade.shutdown()
    assert started.index("new-0") < started.index(f"held-{flood - 1}"), started
