"""The engine's service against hostile and broken peers: messages that are not ours, without
the token, from another gateway, from a gateway cut off by the network or one that stops
reading. No message stops the engine, and no peer costs it unbounded work or memory."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.http_heads import MAX_HEAD_KB
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.sampling import SamplingParams
from loramux.engine.service import serve_engine_in_thread
from loramux.engine.service import server as service_module
from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.wire import (
    Abort,
    Call,
    Delta,
    Failed,
    Reply,
    encode,
)
from tests.engine import service_peer
from tests.engine.service_peer import (
    TOKEN,
    Gateway,
    failure_of,
    gateway_at,
    generate,
    wait_idle,
)
from tests.raw_http import Connection, head

# The service and a gateway socket on it, as fixtures here (not in the engine conftest, which the
# GPU suite loads on an image without pyzmq or uvicorn).
service, gateway = service_peer.service, service_peer.gateway


def test_a_malformed_or_hostile_message_is_dropped_or_refused_and_the_engine_serves_on(
    gateway: Gateway,
) -> None:
    """Junk is dropped; a message with the token that fails validation is refused as an invalid
    request (dropped, its gateway waited for a first output that never came)."""
    gateway.send(b"\xc1 not msgpack")
    gateway.send(msgspec.msgpack.encode(["generate", TOKEN, "x", [1], {"max_tokens": 0}]))
    gateway.send(msgspec.msgpack.encode(["generate", TOKEN, "y", [1], {"top_p": float("inf")}]))
    gateway.send(msgspec.msgpack.encode(["call", TOKEN, "c", "shutdown"]))
    refused = [failure_of(gateway.receive()) for _ in range(3)]
    assert sorted((f.ref, f.call, f.code) for f in refused) == [
        ("c", True, "invalid_request"),
        ("x", False, "invalid_request"),
        ("y", False, "invalid_request"),
    ]
    assert "max_tokens" in next(f.message for f in refused if f.ref == "x")
    assert isinstance(gateway.stream("after-junk")[-1], Delta)


def _nested(depth: int) -> bytes:
    """A Generate without the token whose sampling params hold a field (`extra`, which they
    once had) of arrays `depth` deep."""
    fields = b"".join(msgspec.msgpack.encode(f) for f in ("generate", "guess", "deep", [1]))
    extra = b"\x81" + msgspec.msgpack.encode("x") + b"\x91" * depth + b"\x01"
    params = b"\x81" + msgspec.msgpack.encode("extra") + extra
    return b"\x95" + fields + params


@pytest.mark.parametrize(
    "frames",
    [
        [_nested(200_000)],  # past the interpreter's recursion limit while skipping
        [b"\x93\xa8prefetch\xa2\xff\xfe\xd9\x40" + b"a" * 64],  # a token not UTF-8
        [encode(Call(TOKEN, "m1", "info")), b"a second part"],  # two parts from a DEALER
        [b"", b"", b""],
    ],
    ids=["nesting", "utf-8", "two parts", "three empty parts"],
)
def test_no_message_without_the_token_stops_the_engine(
    gateway: Gateway, frames: list[bytes]
) -> None:
    """Each of these ended the engine's server (its process, in `loramux engine`), for every
    gateway, before any check of the token."""
    gateway.socket.send_multipart(frames)
    assert isinstance(gateway.stream("after-attack")[-1], Delta)


def test_the_token_is_checked_before_the_rest_of_a_message_is_read(gateway: Gateway) -> None:
    """A wrong token is refused from the message's head alone: a body that is not even valid
    (or, as an attacker sends, hundreds of megabytes of it) is never decoded."""
    gateway.send(msgspec.msgpack.encode(["generate", "guess", "h1", "not token ids", {"n": "x"}]))
    refused = failure_of(gateway.receive())
    assert (refused.ref, refused.code) == ("h1", "unauthorized")
    gateway.send(msgspec.msgpack.encode(["generate", "guess", "h" * 257, [1], {}]))
    gateway.send(msgspec.msgpack.encode(["call", TOKEN, "ok", "info"]))
    answer = gateway.receive()  # an over-long id is dropped, never echoed
    assert isinstance(answer, Reply) and answer.ref == "ok", answer


def test_every_message_needs_the_token(gateway: Gateway, service: RunningEngineService) -> None:
    for wrong in ("", "guess", TOKEN + "x"):
        failed = failure_of(gateway.call("info", token=wrong))
        assert (failed.call, failed.code) == (True, "unauthorized")
        assert failure_of(gateway.stream("anon", token=wrong)).code == "unauthorized"
    assert httpx.get(f"{service.health_url}/health").status_code == 200  # needs none


def test_a_request_head_over_the_bound_is_refused_by_the_health_endpoint(
    service: RunningEngineService,
) -> None:
    """Its HTTP endpoint read a head of any length whole (uvicorn's httptools bounds none)."""
    bound = MAX_HEAD_KB << 10
    with Connection(service.health_url) as http:
        http.send(head("/health", bound))
        assert http.answer().status == 200
        http.send(head("/health", bound + 1))
        assert http.answer().status == 431
        assert http.closed()


def test_an_abort_without_the_token_changes_nothing(gateway: Gateway) -> None:
    gateway.send(generate("kept", params=SamplingParams(max_tokens=40, ignore_eos=True)))
    gateway.send(Abort("guess", "kept"))
    received = [gateway.receive()]
    while not (isinstance(received[-1], Delta) and received[-1].finish_reason is not None):
        received.append(gateway.receive())
    assert isinstance(received[-1], Delta) and received[-1].finish_reason == "length"
    timings = received[-1].timings  # the engine's timestamps travel with the final delta
    assert timings is not None and timings.first_token is not None
    [refused] = [m for m in received if isinstance(m, Failed)]
    assert refused.code == "unauthorized"


@pytest.fixture
def other_gateway(service: RunningEngineService) -> Iterator[Gateway]:
    with gateway_at(service.url) as gateway:
        yield gateway


def test_only_the_gateway_that_started_a_request_can_abort_it(
    gateway: Gateway, other_gateway: Gateway
) -> None:
    """Another gateway with the token, knowing the request id, aborts nothing (each request is
    its gateway's); its own requests it aborts as before."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    gateway.send(generate("mine", params=params))
    assert isinstance(gateway.receive(), Delta)
    other_gateway.send(Abort(TOKEN, "mine"))
    other_gateway.send(generate("theirs", params=params))
    other_gateway.send(Abort(TOKEN, "theirs"))
    received = [gateway.receive()]
    while not (isinstance(received[-1], Delta) and received[-1].finish_reason is not None):
        received.append(gateway.receive())
    assert received[-1].finish_reason == "length"  # type: ignore[union-attr]
    theirs = [other_gateway.receive()]
    while not (isinstance(theirs[-1], Delta) and theirs[-1].finish_reason is not None):
        theirs.append(other_gateway.receive())
    assert theirs[-1].finish_reason == "abort"  # type: ignore[union-attr]


class _Partition:
    """A TCP proxy to the engine that can stop forwarding and keep both connections open: a
    gateway cut off by the network (a partition, a host gone) without a FIN or RST."""

    def __init__(self, target: str):
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.cut = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._forward, daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        client, _ = self._listener.accept()
        with client, socket.create_connection(self._target) as engine:
            while not self.cut.is_set():
                for end in select.select([client, engine], [], [], 0.05)[0]:
                    data = end.recv(65536)
                    if not data:
                        return
                    (engine if end is client else client).sendall(data)
            self._done.wait(120)  # cut: nothing forwarded, nothing closed

    def close(self) -> None:
        self._done.set()
        self._thread.join(10)
        self._listener.close()


def test_a_gateway_cut_off_by_the_network_has_its_requests_aborted(demo_model_dir: Path) -> None:
    """The engine's socket misses the cut-off gateway's heartbeats (1 s here) and drops it; its
    requests end at their next delta, and their KV blocks are freed. Without heartbeats they
    ran to their max_tokens (here 16 sequences of 2,000 tokens) for nobody."""
    config = EngineConfig(model=demo_model_dir, max_model_len=2048, kv_cache_bytes=96 << 20)
    engine = AsyncEngine(LLMEngine(config))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with serve_engine_in_thread(engine, "demo", token=TOKEN, heartbeat_timeout_ms=1000) as running:
        proxy = _Partition(running.url)
        try:
            gateway, cut_off = Gateway(context, running.url), Gateway(context, proxy.url)
            params = SamplingParams(max_tokens=2000, ignore_eos=True, n=4)
            for i in range(4):
                cut_off.send(generate(f"cut-{i}", params=params))
            assert isinstance(cut_off.receive(), Delta)
            proxy.cut.set()
            stats = wait_idle(gateway)
            assert (stats["aborted"], stats["kv_blocks_used"]) == (4, 0)
            assert stats["generated_tokens"] < 4 * 4 * 2000 // 2, stats
        finally:
            context.destroy(linger=0)
            proxy.close()


def test_a_gateway_that_falls_behind_is_told_which_requests_it_lost(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway stops reading (busy for 3 s, under the heartbeat timeout) until its send queue
    is full (200 messages here, and a small socket buffer). The batches that did not fit are
    lost, so their streams end; once the gateway reads again each ends with `request_failed`
    (they hung: aborted in the engine with no last message), and its next request is served
    (it was swallowed while any of its streams ran)."""
    monkeypatch.setattr(service_module, "SEND_QUEUE", 200)
    setup = service_module.EngineServer.__post_init__

    def small_buffers(server: service_module.EngineServer) -> None:
        setup(server)
        server._socket.setsockopt(zmq.SNDBUF, 4096)
        server._socket.setsockopt(zmq.SNDHWM, 1)  # libzmq's own queue fills at once too

    monkeypatch.setattr(service_module.EngineServer, "__post_init__", small_buffers)
    config = EngineConfig(model=demo_model_dir, max_model_len=2048, kv_cache_bytes=96 << 20)
    engine = AsyncEngine(LLMEngine(config))
    with (
        serve_engine_in_thread(engine, "demo", token=TOKEN) as running,
        gateway_at(running.url) as behind,
    ):
        behind.socket.setsockopt(zmq.RCVHWM, 1)
        behind.socket.setsockopt(zmq.RCVBUF, 2048)
        behind.socket.disconnect(running.url)  # the options apply to a new connection
        behind.socket.connect(running.url)
        params = SamplingParams(max_tokens=1500, ignore_eos=True)
        for i in range(2):
            behind.send(generate(f"long-{i}", params=params))
        time.sleep(3)  # not reading: the gateway is busy
        ended: dict[str, str] = {}
        while len(ended) < 2:
            message = behind.receive(30)
            if isinstance(message, Failed):
                ended[message.ref] = message.code
            elif isinstance(message, Delta) and message.finish_reason is not None:
                ended[message.ref] = message.finish_reason
        assert ended == {"long-0": "request_failed", "long-1": "request_failed"}
        assert isinstance(behind.stream("after")[-1], Delta)
