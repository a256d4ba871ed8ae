"""The engine's full queue is shared between owners (engine.queue_share): one owner alone is
refused as before, another owner's request takes the place of the newest queued request of
the owner with the most (which is refused, before any output, its blocks freed), and once
the owners' queued requests are even each one's next request is refused at the door."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import EngineOverloadedError, InvalidRequestError
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from tests.engine.conftest import make_engine

PROMPT = list(range(3, 40))


@pytest.fixture
async def engine(demo_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    """One request runs, two wait."""
    eng = AsyncEngine(make_engine(demo_model_dir, max_num_seqs=1, max_waiting=2))
    eng.start()
    yield eng
    eng.shutdown()


def _request(request_id: str, owner: str | None, max_tokens: int = 470) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(request_id, params, prompt_token_ids=PROMPT, owner=owner)


async def _outputs(engine: AsyncEngine, request: EngineRequest) -> list[RequestOutput]:
    return [out async for out in engine.generate(request)]


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition()` until it holds; fail after 30 s."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


async def _fill(engine: AsyncEngine, owner: str | None) -> list[asyncio.Task[list[RequestOutput]]]:
    """`owner`'s requests in every place: f0 runs, f1 and f2 wait (queued in that order)."""
    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(_outputs(engine, _request(f"f{i}", owner))))
        await _until(lambda i=i: _held(engine) == i + 1, f"request f{i} is in the engine")
    return tasks


def _held(engine: AsyncEngine) -> int:
    stats = engine.stats()
    return stats.running + stats.waiting


async def test_one_owner_alone_is_refused_at_the_door_as_before(engine: AsyncEngine) -> None:
    flood = await _fill(engine, "flooder")
    with pytest.raises(EngineOverloadedError):
        await _outputs(engine, _request("f3", "flooder"))
    assert engine.stats().waiting == 2
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)


async def test_another_owner_takes_the_place_of_the_flooder_s_newest_queued_request(
    engine: AsyncEngine,
) -> None:
    flood = await _fill(engine, "flooder")
    victim = asyncio.create_task(_outputs(engine, _request("v0", "victim", max_tokens=4)))
    with pytest.raises(EngineOverloadedError):
        await flood[2]  # the newest of the flooder's queued requests, before any output
    assert not flood[0].done() and not flood[1].done()
    await _until(lambda: engine.stats().waiting == 2, "f1 and v0 wait")
    # Even now (one queued each): each owner's next request is refused at the door, neither
    # displaces the other's, so two owners that keep sending do not take turns refusing.
    for request in (_request("f3", "flooder"), _request("v1", "victim")):
        with pytest.raises(EngineOverloadedError):
            await _outputs(engine, request)
    flood[0].cancel()
    flood[1].cancel()
    await asyncio.gather(*flood[:2], return_exceptions=True)
    outs = await victim
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 4
    await _until(lambda: _held(engine) == 0, "the engine is idle")
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total


async def test_requests_without_an_owner_share_one(engine: AsyncEngine) -> None:
    flood = await _fill(engine, None)
    with pytest.raises(EngineOverloadedError):
        await _outputs(engine, _request("n3", None))
    victim = asyncio.create_task(_outputs(engine, _request("v0", "tenant", max_tokens=4)))
    with pytest.raises(EngineOverloadedError):
        await flood[2]
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    assert (await victim)[-1].finish_reason == "length"


async def test_an_owner_longer_than_a_salt_is_refused(engine: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError, match="owner"):
        await _outputs(engine, _request("long", "o" * 1025))


async def test_a_request_that_had_an_output_is_never_displaced(demo_model_dir: Path) -> None:
    """Bug: a waiting request whose choice 1 was aborted alone has had an output (that choice's
    end) though none of its sequences ran, and it was still displaced: its stream ended with
    EngineOverloadedError after an output. Now the newest request with no output goes."""
    engine = AsyncEngine(make_engine(demo_model_dir, max_num_seqs=2, max_waiting=2))
    engine.start()
    seen: dict[str, list[RequestOutput | Exception]] = {}

    async def collect(request: EngineRequest) -> None:
        try:
            async for out in engine.generate(request):
                seen[request.request_id].append(out)
        except EngineOverloadedError as exc:
            seen[request.request_id].append(exc)

    def refused(request_id: str) -> bool:
        return any(isinstance(x, EngineOverloadedError) for x in seen[request_id])

    params = SamplingParams(max_tokens=470, ignore_eos=True, n=2)
    tasks = []
    try:
        for i, rid in enumerate(["f0", "f1", "f2", "f3"]):  # f0's two choices run, 3 wait
            seen[rid] = []
            request = EngineRequest(rid, params, prompt_token_ids=PROMPT, owner="flooder")
            tasks.append(asyncio.create_task(collect(request)))
            await _until(lambda i=i: len(engine._streams) == i + 1, f"{rid} registered")
        await _until(lambda: engine.stats().waiting == 3, "f1, f2 and f3 wait")
        engine.abort("f3", choice=1)
        await _until(lambda: len(seen["f3"]) == 1, "f3 had an output")
        seen["v"] = []
        victim = EngineRequest(
            "v", SamplingParams(max_tokens=2), prompt_token_ids=PROMPT, owner="victim"
        )
        tasks.append(asyncio.create_task(collect(victim)))
        await _until(lambda: any(map(refused, ("f1", "f2", "f3", "v"))), "a refusal")
        assert [rid for rid in ("f1", "f2", "f3", "v") if refused(rid)] == ["f2"], seen
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        engine.shutdown()
