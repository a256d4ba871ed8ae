"""CURVE on the engine channel's tcp:// connections (engine.service.curve): what crosses the
network is encrypted, a peer without the engine token's keys gets no message through (not even
buffered), a gateway with another token is told why it cannot connect, and an engine does not
listen beyond its host without a token."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.errors import EngineStoppedError
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.service import serve_engine_in_thread
from loramux.engine.service.curve import CurveKeys, refuse_open_listener
from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.wire import Call, Delta, Reply, encode
from loramux.gateway.engine_client.remote import RemoteEngineClient
from tests.engine import service_peer
from tests.engine.service_peer import TOKEN, Gateway, gateway_at, generate
from tests.gateway.servers import TcpRelay

service, gateway = service_peer.service, service_peer.gateway
REQUEST_ID = "request-id-an-eavesdropper-would-read"


@contextlib.contextmanager
def tapped(url: str) -> Iterator[TcpRelay]:
    relay = TcpRelay(int(url.rsplit(":", 1)[1]))
    try:
        yield relay
    finally:
        relay.close()


def stream_through(url: str, curve_token: str | None) -> None:
    with gateway_at(url, curve_token) as peer:
        received = peer.stream(REQUEST_ID)
    assert isinstance(received[-1], Delta) and received[-1].finish_reason == "length"


def test_what_crosses_the_network_is_encrypted(
    service: RunningEngineService, demo_model_dir: Path
) -> None:
    """Through a tap, a whole stream shows neither the token nor the request id; the same
    stream to an engine without a token (plain, loopback) shows both: the tap sees the wire."""
    with tapped(service.url) as tap:
        stream_through(tap.url, TOKEN)
    assert len(tap.seen) > 1000
    assert TOKEN.encode() not in tap.seen and REQUEST_ID.encode() not in tap.seen

    config = EngineConfig(model=demo_model_dir, max_model_len=512, kv_cache_bytes=16 << 20)
    with (
        serve_engine_in_thread(AsyncEngine(LLMEngine(config)), "demo") as plain,
        tapped(plain.url) as tap,
    ):
        stream_through(tap.url, None)
    assert REQUEST_ID.encode() in tap.seen


def stranger_at(context: zmq.Context[zmq.Socket[bytes]], url: str, keys: str) -> zmq.Socket[bytes]:
    """A DEALER without the token's keys: plain; with another token's; or with a key pair of
    its own and the engine's public key (public keys leak: the engine's check of the gateway
    key refuses it)."""
    stranger = context.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.SNDTIMEO, 1000)
    if keys == "other-token":
        other = CurveKeys.of("another-token")
        stranger.curve_serverkey, stranger.curve_publickey = (
            other.engine_public,
            other.gateway_public,
        )
        stranger.curve_secretkey = other.gateway_secret
    elif keys == "own-pair":
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        stranger.curve_serverkey = CurveKeys.of(TOKEN).engine_public
    stranger.connect(url)
    return stranger


@pytest.mark.parametrize("keys", ["plain", "other-token", "own-pair"])
def test_a_peer_without_the_token_s_keys_gets_no_message_through(
    service: RunningEngineService,
    gateway: Gateway,
    keys: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It may even know the token: without the keys, its handshake fails, and the engine
    neither answers nor reads its messages (ZeroMQ keeps them on the peer's side, for a
    connection that never comes). A gateway with the keys is served meanwhile."""
    caplog.set_level(logging.WARNING, logger="loramux.engine.service.curve")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        stranger = stranger_at(context, service.url, keys)
        with contextlib.suppress(zmq.Again):
            stranger.send(encode(Call(TOKEN, "stranger", "info")))
            stranger.send(encode(generate("stranger-generate")))
        assert stranger.poll(1500) == 0, "the engine answered a peer without the keys"
    finally:
        context.destroy(linger=0)
    assert isinstance(gateway.call("info"), Reply)
    if keys == "own-pair":  # the others fail before the engine sees a key
        assert "refused a connection whose key is not the engine token's" in caplog.text


async def test_a_gateway_with_another_token_is_told_why_it_cannot_connect(
    service: RunningEngineService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="loramux.gateway.engine_client.channel")
    client = RemoteEngineClient([service.url], "another-token")
    await client.start()
    try:
        with pytest.raises(EngineStoppedError):
            await client.info()
    finally:
        await client.close()
    assert "is LORAMUX_ENGINE_TOKEN the same on the engine and this gateway?" in caplog.text


def test_the_two_ends_keys_derive_from_the_token_alone() -> None:
    keys = CurveKeys.of(TOKEN)
    assert keys == CurveKeys.of(TOKEN)
    assert keys.engine_public == zmq.curve_public(keys.engine_secret)
    assert keys.gateway_public == zmq.curve_public(keys.gateway_secret)
    assert keys.engine_secret != keys.gateway_secret
    assert CurveKeys.of(TOKEN + "x").engine_secret != keys.engine_secret


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:0", "tcp://127.8.0.1:0", "tcp://[::1]:0", "tcp://localhost:0", "ipc:///x"],
)
def test_an_engine_listens_on_its_own_host_without_a_token(address: str) -> None:
    refuse_open_listener(address, None)


@pytest.mark.parametrize(
    "address", ["tcp://0.0.0.0:0", "tcp://*:8100", "tcp://eth0:8100", "tcp://10.1.2.3:8100"]
)
def test_an_engine_does_not_listen_beyond_its_host_without_a_token(address: str) -> None:
    with pytest.raises(ValueError, match="set LORAMUX_ENGINE_TOKEN"):
        refuse_open_listener(address, None)
    refuse_open_listener(address, TOKEN)
