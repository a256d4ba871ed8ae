"""A gateway that started before its engine (gateway.served_identity) asks it for its identity
until it answers; an engine of another release that answers instead is reported, not retried
in silence."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import zmq
import zmq.asyncio

from loramux.engine.service.wire import Call, Reply, decode_to_engine, encode
from loramux.gateway.engine_client.base import EngineInfo
from loramux.gateway.engine_client.remote import RemoteEngineClient
from loramux.gateway.served_identity import ServedIdentity, confirm_identity


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
