"""A request's owner (its tenant) crosses the engine channel (`Generate.owner`): over ZeroMQ,
as in process, the engine's full queue takes another owner's request in place of the newest
queued request of the owner holding the most, which the remote client gets as
EngineOverloadedError before any output (engine.queue_share)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.errors import EngineOverloadedError
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.engine.service import serve_engine_in_thread
from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.engine_client.remote import RemoteEngineClient
from tests.gateway.servers import ENGINE_TOKEN

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def small_service(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningEngineService]:
    """An engine service that runs one request and queues two more."""
    config = EngineConfig(
        model=demo_model_dir, max_model_len=512, num_kv_blocks=256, max_num_seqs=1, max_waiting=2
    )
    engine = AsyncEngine(LLMEngine(config))
    adapters = tmp_path_factory.mktemp("engine-small")
    with serve_engine_in_thread(
        engine, "demo", address="tcp://127.0.0.1:0", adapter_dir=adapters, token=ENGINE_TOKEN
    ) as service:
        yield service


@pytest.fixture
async def client(small_service: RunningEngineService) -> AsyncIterator[RemoteEngineClient]:
    remote = RemoteEngineClient([small_service.url], ENGINE_TOKEN)
    await remote.start()
    yield remote
    await remote.close()


def _request(request_id: str, owner: str, max_tokens: int = 470) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(request_id, params, prompt_token_ids=PROMPT, owner=owner)


async def _outputs(client: RemoteEngineClient, request: EngineRequest) -> list[RequestOutput]:
    return [out async for out in client.generate(request)]


async def _until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Await `condition()` until it is true; fail after 30 s."""
    deadline = time.monotonic() + 30
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


async def test_the_owner_crosses_the_wire_and_shares_the_full_queue(
    client: RemoteEngineClient,
) -> None:
    async def held(n: int) -> bool:
        [stats] = await client.stats()
        return stats.running + stats.waiting == n

    flood = []
    for i in range(3):  # f0 runs, f1 and f2 wait, in that order
        flood.append(asyncio.create_task(_outputs(client, _request(f"wf{i}", "flooder"))))
        await _until(lambda i=i: held(i + 1), f"request wf{i} is in the engine")
    with pytest.raises(EngineOverloadedError):  # one owner alone: refused at the door
        await _outputs(client, _request("wf3", "flooder"))
    victim = asyncio.create_task(_outputs(client, _request("wv0", "victim", max_tokens=4)))
    with pytest.raises(EngineOverloadedError):
        await flood[2]  # displaced, before any output
    assert not flood[0].done() and not flood[1].done()
    flood[0].cancel()
    flood[1].cancel()
    await asyncio.gather(*flood[:2], return_exceptions=True)
    outs = await victim
    assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == 4
