"""The remote engine client against real engine services on loopback (the ZeroMQ channel over
tcp://): the same token ids as the local engine, typed errors across the wire, adapters
uploaded on demand, aborts that free KV blocks, adapter affinity and failover between two
engines."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.errors import (
    EngineStoppedError,
    InvalidRequestError,
    PromptTooLongError,
    UnknownAdapterError,
)
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.prompt import prompt_token_ids
from loramux.engine.sampling import SamplingParams
from loramux.engine.service.runner import RunningEngineService, serve_engine_in_thread
from loramux.engine.service.wire import (
    WIRE_VERSION,
    Call,
    Reply,
    UnauthorizedError,
    decode_to_engine,
    encode,
)
from loramux.gateway.engine_client.base import EngineVersionError
from loramux.gateway.engine_client.remote import RemoteEngineClient
from loramux.gateway.engine_client.routing import Endpoint, affinity_key, route
from tests.gateway.remote_engine.common import (
    CLASS_TREE,
    IMPORT_OS,
    PARAMS,
    WHILE_TRUE,
    collect,
    run_locally,
    served_by,
    tokens_of,
)
from tests.gateway.servers import ENGINE_TOKEN, engine_service


@pytest.mark.parametrize(
    "form",
    [
        {"prompt": "def tokenize(source):"},
        {"prompt_token_ids": [5, 17, 300, 41, 9, 2000, 7]},
        {"messages": [{"role": "user", "content": "Explain paging."}]},
    ],
)
async def test_remote_generate_equals_local_token_for_token(
    client: RemoteEngineClient, local: LLMEngine, form: dict[str, Any]
) -> None:
    ids = prompt_token_ids(local.tokenizer, EngineRequest("ids", PARAMS, **form), 4096, 512)
    remote = await collect(
        client, EngineRequest(f"eq-{next(iter(form))}", PARAMS, prompt_token_ids=ids)
    )
    reference = run_locally(local, EngineRequest("eq-local", PARAMS, **form))
    assert tokens_of(remote) == tokens_of(reference)
    assert remote[-1].finish_reason == reference[-1].finish_reason == "length"
    assert remote[-1].usage is not None and reference[-1].usage is not None
    assert remote[-1].usage.prompt_tokens == reference[-1].usage.prompt_tokens == len(ids)
    assert all(not o.finished for o in remote[:-1])


async def test_a_request_given_as_text_is_refused_before_it_leaves(
    client: RemoteEngineClient,
) -> None:
    for form in ({"prompt": "x"}, {"messages": [{"role": "user", "content": "x"}]}):
        with pytest.raises(InvalidRequestError):
            await anext(client.generate(EngineRequest("text", PARAMS, **form)))


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (EngineRequest("e1", PARAMS, prompt_token_ids=[7] * 600), PromptTooLongError),
        (EngineRequest("e2", PARAMS, prompt_token_ids=[7], adapter="0" * 64), UnknownAdapterError),
        (EngineRequest("e3", PARAMS, prompt_token_ids=[2**40]), InvalidRequestError),
        (EngineRequest("e4", PARAMS, prompt_token_ids=[]), InvalidRequestError),
    ],
)
async def test_typed_errors_cross_the_wire_before_any_delta(
    client: RemoteEngineClient, request_: EngineRequest, error: type[Exception]
) -> None:
    with pytest.raises(error) as raised:
        await anext(client.generate(request_))
    assert type(raised.value) is error


async def test_info_ready_and_stats(client: RemoteEngineClient) -> None:
    info = await client.info()
    assert (info.model_name, info.max_model_len, info.vocab_size) == ("demo", 512, 4096)
    assert await client.ready()
    [stats] = await client.stats()
    assert stats.kv_blocks_total > 0


async def test_an_engine_of_another_channel_version_is_refused_by_name() -> None:
    """An engine from an older release answers `info` without the channel version (or with
    another): the gateway refuses it with an error that says so, before any stream could fail
    on frames it cannot read."""
    context = zmq.asyncio.Context()
    old_engine = context.socket(zmq.ROUTER)
    port = old_engine.bind_to_random_port("tcp://127.0.0.1")

    async def answer_info() -> None:
        identity, frame = await old_engine.recv_multipart()
        call = decode_to_engine(frame)
        assert isinstance(call, Call) and call.op == "info"
        body = {"model_name": "demo", "max_model_len": 512, "vocab_size": 4096}
        await old_engine.send_multipart([identity, encode(Reply(call.ref, body))])

    client = RemoteEngineClient([f"tcp://127.0.0.1:{port}"])
    answering = asyncio.create_task(answer_info())
    try:
        with pytest.raises(
            EngineVersionError, match=f"version 1, this gateway version {WIRE_VERSION}"
        ):
            await client.info()
        await answering
    finally:
        await client.close()
        old_engine.close(linger=0)
        context.term()


def test_a_client_whose_engine_address_zeromq_refuses_still_closes() -> None:
    """The channel whose connect raised left its socket open, so the client's close waited in
    the ZeroMQ context's term() for good: serve never ended after such a failed start."""
    closed = threading.Event()

    async def fail_then_close() -> None:
        client = RemoteEngineClient(["tcp://127.0.0.1"])  # no port: refused by connect
        await client.start()
        with contextlib.suppress(zmq.ZMQError):
            await client.info()
        await client.close()
        closed.set()

    threading.Thread(target=asyncio.run, args=(fail_then_close(),), daemon=True).start()
    assert closed.wait(60)


async def test_a_wrong_token_is_refused(
    services: list[RunningEngineService], demo_model_dir: Path, tmp_path: Path
) -> None:
    """Over tcp:// at the handshake (CURVE: tests/engine/test_channel_curve.py); over ipc://,
    where the socket file's permissions guard the channel, by the engine's answer."""
    intruder = RemoteEngineClient([services[0].url], "wrong")
    try:
        with pytest.raises(EngineStoppedError):
            await intruder.info()
    finally:
        await intruder.close()
    with engine_service(demo_model_dir, tmp_path, f"ipc://{tmp_path}/engine.sock") as on_ipc:
        intruder = RemoteEngineClient([on_ipc.url], "wrong")
        try:
            with pytest.raises(UnauthorizedError):
                await intruder.info()
        finally:
            await intruder.close()


async def test_adapter_given_by_ensure_adapter_serves_like_the_local_engine(
    client: RemoteEngineClient, local: LLMEngine, demo_adapter_dirs: list[Path]
) -> None:
    folder = demo_adapter_dirs[3]
    digest = local.register_adapter(folder)
    await client.ensure_adapter(digest, folder)
    request = EngineRequest("lora-1", PARAMS, prompt_token_ids=IMPORT_OS, adapter=digest)
    remote = await collect(client, request)
    assert tokens_of(remote) == tokens_of(run_locally(local, request))
    base = run_locally(local, EngineRequest("lora-base", PARAMS, prompt_token_ids=IMPORT_OS))
    assert tokens_of(remote) != tokens_of(base)  # the adapter changed the output


async def test_an_engine_that_lost_an_adapter_gets_it_again(
    client: RemoteEngineClient, services: list[RunningEngineService], demo_adapter_dirs: list[Path]
) -> None:
    folder = demo_adapter_dirs[4]
    digest = await services[0].engine.register_adapter(folder)
    await client.ensure_adapter(digest, folder)
    services[0].engine.retire_adapter(digest)  # as if the engine restarted without it
    outputs = await collect(
        client, EngineRequest("lost-1", PARAMS, prompt_token_ids=[7], adapter=digest)
    )
    assert outputs[-1].finish_reason == "length"


async def test_closing_the_stream_midway_aborts_and_frees_every_block(
    client: RemoteEngineClient,
) -> None:
    params = SamplingParams(max_tokens=490, ignore_eos=True)
    stream = client.generate(EngineRequest("abort-1", params, prompt_token_ids=CLASS_TREE))
    for _ in range(3):
        assert not (await anext(stream)).finished
    await stream.aclose()  # type: ignore[attr-defined]
    for _ in range(1000):
        [stats] = await client.stats()
        if stats.running == stats.waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert stats.running == stats.waiting == 0
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total


async def test_an_aborted_stream_ends_with_usage_counting_every_token_generated(
    client: RemoteEngineClient,
) -> None:
    params = SamplingParams(max_tokens=490, ignore_eos=True)
    stream = client.generate(EngineRequest("abort-2", params, prompt_token_ids=CLASS_TREE))
    outputs = [await anext(stream) for _ in range(3)]
    await client.abort("abort-2")
    outputs += [out async for out in stream]
    final = outputs[-1]
    assert final.finish_reason == "abort" and final.usage is not None
    assert final.usage.completion_tokens == len(tokens_of(outputs)) < 490
    [stats] = await client.stats()
    assert stats.running == stats.waiting == stats.kv_blocks_used == 0


async def _until(what: str, done: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + 30
    while not await done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _prompt_preferring(url: str, endpoints: list[Endpoint]) -> list[int]:
    """Prompt token ids whose request routing sends to `url` first."""
    for first in range(1000):
        ids = [first, *IMPORT_OS]
        key = affinity_key(EngineRequest("k", PARAMS, prompt_token_ids=ids))
        if route(endpoints, key)[0].url == url:
            return ids
    raise AssertionError(f"no prompt prefers {url}")


async def test_a_request_aborted_while_queued_in_the_engine_ends_there_computing_nothing(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """The engine here runs one sequence at a time; a request queued behind a long one is
    aborted in the engine at once: it ends with its final output, no token generated. The
    bug: the client only remembered the abort until the request's first output, so the
    engine prefilled it and generated a token for a client that had gone, who was billed."""
    config = EngineConfig(
        model=demo_model_dir, max_model_len=512, kv_cache_bytes=16 << 20, max_num_seqs=1
    )
    engine = AsyncEngine(LLMEngine(config))
    with serve_engine_in_thread(engine, "demo", adapter_dir=tmp_path, token=ENGINE_TOKEN) as one:
        remote = RemoteEngineClient([one.url], ENGINE_TOKEN)
        long = SamplingParams(max_tokens=490, ignore_eos=True)
        running = remote.generate(EngineRequest("running", long, prompt_token_ids=CLASS_TREE))
        try:
            await anext(running)
            queued = asyncio.ensure_future(
                collect(remote, EngineRequest("queued", PARAMS, prompt_token_ids=IMPORT_OS))
            )

            async def waits() -> bool:
                [stats] = await remote.stats()
                return stats.waiting == 1

            await _until("the request to wait in the engine", waits)
            await remote.abort("queued")
            async with asyncio.timeout(30):
                outputs = await queued
            assert [o.finish_reason for o in outputs] == ["abort"]
            assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 0
        finally:
            await running.aclose()  # type: ignore[attr-defined]
            await remote.close()


async def test_a_request_aborted_while_its_engine_fails_is_sent_to_no_other(
    services: list[RunningEngineService],
) -> None:
    """A request aborted while it was being sent to an engine that turns out unreachable ends
    with that engine's error; the next engine never gets it. The bug: it failed over to the
    next engine, which computed it for a client that had gone."""
    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    live = services[1]
    ids = _prompt_preferring(dead, [Endpoint(dead), Endpoint(live.url)])
    pair = RemoteEngineClient([dead, live.url], ENGINE_TOKEN)
    before = live.engine.stats().generated_tokens
    try:
        opening = asyncio.ensure_future(
            collect(pair, EngineRequest("gone", PARAMS, prompt_token_ids=ids))
        )
        await asyncio.sleep(0)  # it is being sent to the dead engine: waits for a connection
        await pair.abort("gone")
        with pytest.raises(EngineStoppedError):
            await opening
        assert live.engine.stats().generated_tokens == before
        assert live.engine.stats().running == live.engine.stats().waiting == 0
    finally:
        await pair.close()


async def test_requests_for_one_adapter_land_on_one_engine(
    services: list[RunningEngineService], local: LLMEngine, demo_adapter_dirs: list[Path]
) -> None:
    both = RemoteEngineClient([s.url for s in services], ENGINE_TOKEN)
    await both.start()
    try:
        digests = []
        for folder in demo_adapter_dirs[10:16]:
            digest = local.register_adapter(folder)
            digests.append(digest)
            await both.ensure_adapter(digest, folder)
        requests = [
            EngineRequest(f"aff-{i}-{j}", PARAMS, prompt_token_ids=[40 + j, 9, 11], adapter=d)
            for i, d in enumerate(digests)
            for j in range(3)
        ]
        await asyncio.gather(*(collect(both, r) for r in requests))
        assert all(len(served_by(services, d)) == 1 for d in digests)
        assert len(await both.stats()) == 2
    finally:
        await both.close()


async def test_when_an_engine_stops_requests_go_to_the_other(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], local: LLMEngine, tmp_path: Path
) -> None:
    folder = demo_adapter_dirs[5]
    digest = local.register_adapter(folder)
    request = EngineRequest("fo-1", PARAMS, prompt_token_ids=WHILE_TRUE, adapter=digest)
    with (
        engine_service(demo_model_dir, tmp_path / "a") as a,
        engine_service(demo_model_dir, tmp_path / "b") as b,
    ):
        pair = RemoteEngineClient([a.url, b.url], ENGINE_TOKEN)
        await pair.start()
        try:
            await pair.ensure_adapter(digest, folder)
            first = await collect(pair, request)
            [preferred] = served_by([a, b], digest)
            [a, b][preferred].stop()
            again = await collect(
                pair, EngineRequest("fo-2", PARAMS, prompt_token_ids=WHILE_TRUE, adapter=digest)
            )
            assert served_by([a, b], digest) == [0, 1]
            assert tokens_of(again) == tokens_of(first) == tokens_of(run_locally(local, request))
            base = await collect(pair, EngineRequest("fo-3", PARAMS, prompt_token_ids=[7, 8]))
            assert base[-1].finish_reason == "length"
            assert await pair.ready()
            answered = [s is not None for s in await pair.stats()]
            assert answered == [i != preferred for i in range(2)]  # each engine in its place
        finally:
            await pair.close()


def test_routing_prefers_the_affine_engine_unless_it_is_down_or_much_busier() -> None:
    endpoints = [Endpoint(f"tcp://engine-{i}:8100") for i in range(4)]
    order = route(endpoints, "adapter:abc")
    preferred = order[0]
    assert route(endpoints, "adapter:abc")[0] is preferred  # stable
    assert {route(endpoints, f"adapter:{k}")[0].url for k in range(64)} == {
        e.url for e in endpoints
    }

    preferred.load = 3
    assert route(endpoints, "adapter:abc")[0] is preferred  # a little busier: keep affinity
    preferred.load = 50
    assert route(endpoints, "adapter:abc")[0] is not preferred
    assert route(endpoints, "adapter:abc")[1] is preferred

    preferred.load = 0
    preferred.mark_down()
    order = route(endpoints, "adapter:abc")
    assert order[0] is not preferred and order[-1] is preferred


async def test_a_pushed_stream_hands_its_sink_what_generate_yields(
    client: RemoteEngineClient,
) -> None:
    """`stream` (the channel's reader hands each output to the sink) and `generate` (the caller
    reads them) give the same outputs, in order, ending with the one that carries usage."""
    pulled = await collect(client, EngineRequest("pull", PARAMS, prompt_token_ids=IMPORT_OS))
    pushed: list[RequestOutput] = []
    await client.stream(EngineRequest("push", PARAMS, prompt_token_ids=IMPORT_OS), pushed.append)
    assert tokens_of(pushed) == tokens_of(pulled) and len(tokens_of(pushed)) == PARAMS.max_tokens
    assert pushed[-1].usage is not None and all(o.usage is None for o in pushed[:-1])


async def test_a_sink_that_fails_ends_its_own_stream_aborted_and_no_other(
    client: RemoteEngineClient,
) -> None:
    """The sink runs on the channel's reader, which serves every stream of the engine: its
    error ends its own stream (raised by `stream`, the engine's sequence aborted), and the
    stream beside it, on the same channel, goes on to its end."""
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    [before] = await client.stats()
    seen: list[RequestOutput] = []

    def failing(out: RequestOutput) -> None:
        seen.append(out)
        if len(seen) == 3:
            raise ValueError("the sink failed")

    beside: list[RequestOutput] = []
    both = asyncio.gather(
        client.stream(EngineRequest("sink-fails", long, prompt_token_ids=CLASS_TREE), failing),
        client.stream(
            EngineRequest("sink-beside", PARAMS, prompt_token_ids=WHILE_TRUE), beside.append
        ),
        return_exceptions=True,
    )
    outcomes = await asyncio.wait_for(both, 60)
    assert isinstance(outcomes[0], ValueError) and outcomes[1] is None
    assert len(seen) == 3
    assert len(tokens_of(beside)) == PARAMS.max_tokens and beside[-1].usage is not None

    async def settled() -> Any:
        while True:
            [stats] = await client.stats()
            if stats.aborted > before.aborted and stats.running == 0:
                return stats
            await asyncio.sleep(0.02)

    stats = await asyncio.wait_for(settled(), 30)
    assert stats.kv_blocks_used == 0
