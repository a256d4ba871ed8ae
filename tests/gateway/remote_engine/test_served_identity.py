"""A gateway that started before its engine (gateway.served_identity) asks it for its identity
until it answers; an engine of another release that answers instead is reported, not retried
in silence. Engines behind one gateway serve one model: one that serves another is refused by
name (gateway.engine_client.admission)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from loramux.engine.outputs import EngineRequest
from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.wire import Call, Reply, decode_to_engine, encode
from loramux.gateway.engine_client.base import EngineInfo
from loramux.gateway.engine_client.remote import RemoteEngineClient
from loramux.gateway.served_identity import ServedIdentity, confirm_identity
from tests.gateway.remote_engine.common import PARAMS, collect
from tests.gateway.servers import ENGINE_TOKEN, TcpRelay, engine_service


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another checkpoint of the demo model (another seed): the same name, shapes and
    vocabulary, other weights, as when one engine of a fleet was given a new checkpoint."""
    from loramux.engine.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("other-demo-model"), seed=1)


@pytest.fixture(scope="module")
def two_checkpoints(
    demo_model_dir: Path, other_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunningEngineService]]:
    """An engine of the demo model, and one of the other checkpoint (started before a test's
    log capture, which their start would otherwise replace)."""
    with (
        engine_service(demo_model_dir, tmp_path_factory.mktemp("engine-a")) as a,
        engine_service(other_model_dir, tmp_path_factory.mktemp("engine-b")) as b,
    ):
        yield [a, b]


async def eventually(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 30
    while not await condition():
        assert time.monotonic() < deadline, f"not within 30 s: {what}"
        await asyncio.sleep(0.05)


def errors_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def requests_spread_over_engines(client: RemoteEngineClient) -> None:
    """Base-model requests whose prompts route them to every engine that is used."""
    for i in range(12):
        prompt = [100 + 37 * i, 5, 17, 300 + i, 41]
        await collect(client, EngineRequest(f"spread-{i}", PARAMS, prompt_token_ids=prompt))


async def test_an_engine_serving_another_checkpoint_is_refused_by_name_and_sent_nothing(
    two_checkpoints: list[RunningEngineService], caplog: pytest.LogCaptureFixture
) -> None:
    """Bug: `info` asked the one engine routing picked, and the gateway took its answer as
    every engine's: an engine of LORAMUX_ENGINE_URLS serving another checkpoint got about half
    the requests, answered as the first model's (cached and fingerprinted under its identity).
    Now each engine is asked: the first sets the model, and one that serves another is refused,
    logged as an error naming it and what differs, counts as down and is sent no request."""
    a, b = two_checkpoints
    pair = RemoteEngineClient([a.url, b.url], ENGINE_TOKEN)
    caplog.set_level(logging.INFO)
    try:
        await pair.start()
        assert (await pair.info()).model_identity == a.engine.engine.model_identity
        [error] = errors_of(caplog)
        assert b.url in error and "model identity" in error and a.url in error
        await requests_spread_over_engines(pair)
        assert b.engine.stats().steps == 0
        assert [s is not None for s in await pair.stats()] == [True, False]
        assert {i: t is not None for i, t in (await pair.metrics()).items()} == {
            "0": True,
            "1": False,
        }
        assert len(errors_of(caplog)) == 1  # once, however often it is judged
    finally:
        await pair.close()


async def test_an_engine_of_another_checkpoint_that_comes_later_is_refused_when_it_does(
    two_checkpoints: list[RunningEngineService], caplog: pytest.LogCaptureFixture
) -> None:
    """An engine unreachable at the start (or reconnected since) is asked for its `info` once
    it answers, before anything is routed to it: serving another checkpoint, it is refused."""
    a, b = two_checkpoints
    relay = TcpRelay(int(b.url.rsplit(":", 1)[1]))
    relay.block()
    pair = RemoteEngineClient([a.url, relay.url], ENGINE_TOKEN)
    caplog.set_level(logging.INFO)
    try:
        await pair.start()
        assert (await pair.info()).model_identity == a.engine.engine.model_identity
        assert not any("another model" in e for e in errors_of(caplog))
        relay.unblock()

        async def refused() -> bool:
            await pair.stats()  # asked of every engine, as /health and /metrics do
            return any(f"{relay.url} serves another model" in e for e in errors_of(caplog))

        await eventually(refused, f"{relay.url} refused")
        await requests_spread_over_engines(pair)
        assert b.engine.stats().steps == 0
        assert [s is not None for s in await pair.stats()] == [True, False]
    finally:
        await pair.close()
        relay.close()


async def test_an_engine_of_another_release_found_after_a_degraded_start_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bug: every refusal was retried with a debug line, so an engine of another release (at
    a normal start refused by name) went unreported, and /ready said ready. Now it is an
    error, logged once however often it is asked, and the identity stays a stand-in (which
    keeps /ready at 503)."""
    context = zmq.asyncio.Context()
    old_engine = context.socket(zmq.ROUTER)
    port = old_engine.bind_to_random_port("tcp://127.0.0.1")
    answered = 0

    async def answer_info_without_a_version() -> None:
        nonlocal answered
        while True:
            peer, frame = await old_engine.recv_multipart()
            call = decode_to_engine(frame)
            if isinstance(call, Call) and call.op == "info":
                body = {"model_name": "demo", "max_model_len": 512, "vocab_size": 4096}
                await old_engine.send_multipart([peer, encode(Reply(call.ref, body))])
                answered += 1

    client = RemoteEngineClient([f"tcp://127.0.0.1:{port}"])
    await client.start()
    identity = ServedIdentity.stand_in()
    assumed = EngineInfo("demo", 512, 4096, identity.model_identity, identity.build)
    answering = asyncio.create_task(answer_info_without_a_version())
    caplog.set_level(logging.INFO, logger="loramux.gateway.served_identity")
    confirming = asyncio.create_task(confirm_identity(client, identity, assumed))
    try:
        deadline = time.monotonic() + 60
        while answered < 3:
            assert time.monotonic() < deadline, f"the engine was asked {answered} times"
            await asyncio.sleep(0.05)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "channel version" in errors[0], errors
        assert not identity.confirmed and not confirming.done()
    finally:
        confirming.cancel()
        answering.cancel()
        await client.close()
        old_engine.close(linger=0)
        context.term()
