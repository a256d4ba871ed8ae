"""Adapters sent to a remote engine: refused before they leave when over its limit, in
parts of at most a frame, retired or given up while they upload, retired on an engine that was
unreachable once it is back; and calls cancelled as their answer arrives."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from loramux.adapters.errors import FileTooLarge
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.errors import InvalidRequestError, UnknownAdapterError
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import FinishReason
from loramux.engine.service import serve_engine_in_thread
from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.wire import MAX_FRAME_BYTES
from loramux.gateway.engine_client.remote import RemoteEngineClient
from tests.gateway.remote_engine.common import (
    CLASS_TREE,
    IMPORT_OS,
    PARAMS,
    collect,
    run_locally,
    tokens_of,
)
from tests.gateway.servers import ENGINE_TOKEN, TcpRelay, engine_service


async def test_an_adapter_over_the_engines_limit_is_refused_before_it_is_sent(
    demo_model_dir: Path, local: LLMEngine, demo_adapter_dirs: list[Path]
) -> None:
    """An adapter over the engine's limit (scaled down here to 2 MiB; the adapter's weights
    are 4.6 MB) is refused with its size and the engine's limit before any of it is sent, and
    the stream under way runs on. (When an upload was one message, one over the limit made the
    engine drop the gateway's connection, and every stream on it, any tenant's.)"""
    big, small = demo_adapter_dirs[15], demo_adapter_dirs[0]
    assert (big / "adapter_model.safetensors").stat().st_size > 2 << 20
    engine = AsyncEngine(LLMEngine(EngineConfig(model=demo_model_dir, max_model_len=512)))
    with serve_engine_in_thread(engine, "demo", token=ENGINE_TOKEN, max_adapter_mb=2) as served:
        client = RemoteEngineClient([served.url], ENGINE_TOKEN)
        await client.start()
        try:
            params = SamplingParams(max_tokens=48, ignore_eos=True)
            stream = client.generate(EngineRequest("bystander", params, prompt_token_ids=IMPORT_OS))
            first = await anext(stream)
            with pytest.raises(FileTooLarge, match="at most 2097152 bytes"):
                await client.ensure_adapter(local.register_adapter(big), big)
            await client.ensure_adapter(local.register_adapter(small), small)
            outputs = [first] + [out async for out in stream]
        finally:
            await client.close()
    assert sum(len(out.token_ids) for out in outputs) == 48
    assert outputs[-1].finish_reason == FinishReason.LENGTH


async def test_an_adapter_larger_than_a_part_crosses_in_parts_and_serves_the_same(
    services: list[RunningEngineService], local: LLMEngine, demo_adapter_dirs: list[Path]
) -> None:
    """Uploads travel in parts (here of 512 KiB; 8 MiB by default) so that no frame is over
    the engine's small frame limit: a 4.6 MB adapter arrives whole and serves the tokens the
    local engine gives."""
    big = demo_adapter_dirs[15]
    assert (big / "adapter_model.safetensors").stat().st_size > 8 * (512 << 10)
    client = RemoteEngineClient([services[1].url], ENGINE_TOKEN, upload_part_bytes=512 << 10)
    try:
        digest = local.register_adapter(big)
        await client.ensure_adapter(digest, big)
        request = EngineRequest("parts-1", PARAMS, prompt_token_ids=CLASS_TREE, adapter=digest)
        assert tokens_of(await collect(client, request)) == tokens_of(run_locally(local, request))
    finally:
        await client.close()


async def test_a_message_over_the_frame_limit_is_refused_before_it_is_sent(
    client: RemoteEngineClient,
) -> None:
    """The engine drops a connection that sends a frame over its limit, and with it every
    stream of that gateway: a request that would not fit is refused alone (invalid_request),
    and the stream under way runs on."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    stream = client.generate(EngineRequest("beside-it", params, prompt_token_ids=IMPORT_OS))
    first = await anext(stream)
    huge = SamplingParams(max_tokens=4, stop=("x" * MAX_FRAME_BYTES,))
    with pytest.raises(InvalidRequestError, match="carries at most"):
        await collect(client, EngineRequest("huge", huge, prompt_token_ids=IMPORT_OS))
    outputs = [first] + [out async for out in stream]
    assert sum(len(out.token_ids) for out in outputs) == 48


async def test_a_call_cancelled_as_its_answer_arrives_is_cancelled(
    client: RemoteEngineClient,
) -> None:
    """A caller cancelled in the same turn its answer lands is cancelled all the same: on
    Python 3.11 asyncio.wait_for returned the answer and swallowed the cancel, so a request
    whose client left went on uploading an adapter's parts (found by attacking the fixes)."""
    channel = client._channel(client._endpoints[0])
    call = asyncio.create_task(channel.call("stats", 5.0))
    async with asyncio.timeout(10):
        while not channel._calls:  # its message is sent: it waits on its answer
            await asyncio.sleep(0)
    await asyncio.sleep(0)
    next(iter(channel._calls.values())).set_result({"answered": True})
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_an_adapter_retired_while_it_is_uploaded_is_not_served(
    services: list[RunningEngineService], demo_adapter_dirs: list[Path], local: LLMEngine
) -> None:
    """A retire (its tenant deleted it) that reaches the engine before the upload's first part
    retires nothing there: the gateway sees the digest retired once its upload is done, retires
    it again and answers as for a deleted adapter. It used to be served, its files kept, for
    good."""
    folder = demo_adapter_dirs[8]
    digest = local.register_adapter(folder)
    client = RemoteEngineClient([services[1].url], ENGINE_TOKEN)
    await client.start()
    try:
        channel = client._channel(client._endpoints[0])
        upload = asyncio.create_task(client.ensure_adapter(digest, folder))
        async with asyncio.timeout(10):
            while not channel._calls:  # it asks the engine's adapter limit first
                await asyncio.sleep(0)
        await client.retire_adapter(digest)
        with pytest.raises(UnknownAdapterError):
            await upload
        served = await channel.call("adapters", 5.0)
    finally:
        await client.close()
    assert digest not in served and digest not in client._endpoints[0].adapters


async def test_an_upload_given_up_is_dropped_by_the_engine_at_once(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], local: LLMEngine, tmp_path: Path
) -> None:
    """A request cancelled mid-upload (its client left) tells the engine, which drops the
    upload and its files at once: it used to hold its share of the engine's bound on uploads
    under way for a minute, and four of them locked every other upload out."""
    folder = demo_adapter_dirs[11]
    digest = local.register_adapter(folder)
    with engine_service(demo_model_dir, tmp_path) as service:
        client = RemoteEngineClient([service.url], ENGINE_TOKEN, upload_part_bytes=512)
        await client.start()
        try:
            upload = asyncio.create_task(client.ensure_adapter(digest, folder))
            async with asyncio.timeout(30):
                while not any(p.stat().st_size for p in tmp_path.glob("run-*/.uploading/*/*")):
                    await asyncio.sleep(0.01)  # another thread's files: nothing to await
            upload.cancel()
            with pytest.raises(asyncio.CancelledError):
                await upload
            async with asyncio.timeout(10):
                while list(tmp_path.glob("run-*/.uploading/*")):
                    await asyncio.sleep(0.01)
        finally:
            await client.close()


async def test_a_retire_an_unreachable_engine_missed_is_sent_once_it_is_back(
    services: list[RunningEngineService], demo_adapter_dirs: list[Path]
) -> None:
    """An adapter deleted while one engine of two is unreachable (a partition, a paused
    process: it did not restart, so it still holds the adapter). Bug: the retire it missed was
    logged and forgotten, and the deleted tenant's weights stayed loaded, and on that engine's
    disk, for as long as it ran. Now the engine is sent it when it is back, before anything
    else is routed to it."""
    a, b = services
    folder = demo_adapter_dirs[7]
    relay = TcpRelay(int(b.url.rsplit(":", 1)[1]))
    pair = RemoteEngineClient([a.url, relay.url], ENGINE_TOKEN)
    lora = b.engine.engine.lora
    assert lora is not None
    try:
        digest = await b.engine.register_adapter(folder)  # another gateway's upload served there
        await pair.start()
        await pair.ensure_adapter(digest, folder)
        relay.block()  # b unreachable from this gateway
        await pair.retire_adapter(digest)  # its delete
        assert lora.is_servable(digest)
        relay.unblock()
        deadline = time.monotonic() + 30
        while lora.is_servable(digest):
            assert time.monotonic() < deadline, "engine b still serves the deleted adapter"
            await pair.stats()  # what a live gateway asks every engine (/health, /metrics)
            await asyncio.sleep(0.05)
        assert all(s is not None for s in await pair.stats())
    finally:
        await pair.close()
        relay.close()
