"""Speaking to a real engine service as a gateway would, message by message: a bare DEALER
socket, and the demo engine served on a loopback port."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.sampling import SamplingParams
from loramux.engine.service import serve_engine_in_thread
from loramux.engine.service.curve import CurveKeys, uses_curve
from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.wire import (
    UPLOAD_PART_BYTES,
    Call,
    Delta,
    Failed,
    Generate,
    Reply,
    ToEngine,
    ToGateway,
    decode_to_gateway,
    encode,
)

TOKEN = "engine-secret"
PROMPT = [5, 17, 300, 41, 9]


class Gateway:
    """A bare DEALER socket: send messages, receive the engine's, with a deadline. Over tcp://
    it runs CURVE with the keys of `curve_token` (engine.service.curve), as a gateway holding
    that token does; None: plain, as a peer without it."""

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], url: str, curve_token: str | None = TOKEN
    ):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve_token is not None and uses_curve(url, curve_token):
            keys = CurveKeys.of(curve_token)
            self.socket.curve_serverkey = keys.engine_public
            self.socket.curve_publickey = keys.gateway_public
            self.socket.curve_secretkey = keys.gateway_secret
        self.socket.connect(url)
        self.unread: list[ToGateway] = []
        """The rest of a batch frame already received."""

    def send(self, message: ToEngine | bytes) -> None:
        self.socket.send(message if isinstance(message, bytes) else encode(message))

    def receive(self, timeout_s: float = 60) -> ToGateway:
        """The next message, batches unpacked."""
        if not self.unread:
            assert self.socket.poll(int(timeout_s * 1000)), "the engine did not answer"
            self.unread = decode_to_gateway(self.socket.recv())
        return self.unread.pop(0)

    def call(self, op: Any, token: str = TOKEN, **fields: Any) -> ToGateway:
        self.send(Call(token, f"call-{op}", op, **fields))
        return self.receive()

    def upload(
        self, digest: str, config: bytes, weights: bytes, part_bytes: int = UPLOAD_PART_BYTES
    ) -> list[ToGateway]:
        """Upload an adapter as a gateway does, in `register-part` calls of at most
        `part_bytes` of weights, each sent once the one before is answered; the answers, up
        to the last part's or the first refusal."""
        answers: list[ToGateway] = []
        for offset in range(0, max(len(weights), 1), part_bytes):
            part = weights[offset : offset + part_bytes]
            first = config if offset == 0 else None
            fields = {"digest": digest, "config": first, "offset": offset, "size": len(weights)}
            answers.append(self.call("register-part", weights=part, **fields))
            if not isinstance(answers[-1], Reply):
                break
        return answers

    def stream(self, request_id: str, **fields: Any) -> list[ToGateway]:
        self.send(generate(request_id, **fields))
        received = [self.receive()]
        while isinstance(received[-1], Delta) and received[-1].finish_reason is None:
            received.append(self.receive())
        return received


@contextlib.contextmanager
def gateway_at(url: str, curve_token: str | None = TOKEN) -> Iterator[Gateway]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield Gateway(context, url, curve_token)
    finally:
        context.destroy(linger=0)


def generate(request_id: str, **fields: Any) -> Generate:
    params = fields.pop("params", SamplingParams(max_tokens=12, ignore_eos=True))
    return Generate(
        fields.pop("token", TOKEN), request_id, fields.pop("ids", PROMPT), params, **fields
    )


def stats_of(gateway: Gateway) -> dict[str, Any]:
    reply = gateway.call("stats")
    assert isinstance(reply, Reply)
    return dict(reply.value)


def wait_idle(gateway: Gateway) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = stats_of(gateway)
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
    raise AssertionError(f"the engine never went idle: {stats}")


def failure_of(received: list[ToGateway] | ToGateway) -> Failed:
    last = received[-1] if isinstance(received, list) else received
    assert isinstance(last, Failed), last
    return last


@pytest.fixture(scope="module")
def service(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningEngineService]:
    config = EngineConfig(model=demo_model_dir, max_model_len=512, kv_cache_bytes=16 << 20)
    engine = AsyncEngine(LLMEngine(config))
    adapter_dir = tmp_path_factory.mktemp("engine-adapters")
    with serve_engine_in_thread(engine, "demo", adapter_dir=adapter_dir, token=TOKEN) as running:
        yield running


@pytest.fixture
def gateway(service: RunningEngineService) -> Iterator[Gateway]:
    with gateway_at(service.url) as gateway:
        yield gateway


def adapter_digest(folder: Path, model_dir: Path) -> str:
    """The digest of the PEFT adapter in `folder`, for the model in `model_dir`."""
    return load_peft_adapter(folder, BaseModelSpec.from_model_dir(model_dir)).digest


def upload_folder(gateway: Gateway, digest: str, folder: Path) -> ToGateway:
    """Uploads the adapter in `folder` in parts; the engine's answer to the last part."""
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    return gateway.upload(digest, config, weights)[-1]
