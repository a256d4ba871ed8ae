"""The engine's service: the ZeroMQ channel (streams of token-id deltas, typed errors before the
stream, adapter upload and retirement, the token on every message, aborts when a gateway goes
away) and its HTTP health and metrics endpoint. Spoken to here as a gateway would, message by
message."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.sampling import SamplingParams
from loramux.engine.service import serve_engine_in_thread
from loramux.engine.service import server as service_module
from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.wire import (
    WIRE_VERSION,
    Abort,
    Call,
    Delta,
    Failed,
    Generate,
    Prefetch,
    Reply,
    ToEngine,
    ToGateway,
    decode_to_gateway,
    encode,
)

TOKEN = "engine-secret"
PROMPT = [5, 17, 300, 41, 9]


@pytest.fixture(scope="module")
def service(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningEngineService]:
    config = EngineConfig(model=demo_model_dir, max_model_len=512, kv_cache_bytes=16 << 20)
    engine = AsyncEngine(LLMEngine(config))
    adapter_dir = tmp_path_factory.mktemp("engine-adapters")
    with serve_engine_in_thread(engine, "demo", adapter_dir=adapter_dir, token=TOKEN) as running:
        yield running


class Gateway:
    """A bare DEALER socket: send messages, receive the engine's, with a deadline."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], url: str):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
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

    def stream(self, request_id: str, **fields: Any) -> list[ToGateway]:
        self.send(_generate(request_id, **fields))
        received = [self.receive()]
        while isinstance(received[-1], Delta) and received[-1].finish_reason is None:
            received.append(self.receive())
        return received


@contextlib.contextmanager
def _gateway_at(url: str) -> Iterator[Gateway]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield Gateway(context, url)
    finally:
        context.destroy(linger=0)


@pytest.fixture
def gateway(service: RunningEngineService) -> Iterator[Gateway]:
    with _gateway_at(service.url) as gateway:
        yield gateway


def _generate(request_id: str, **fields: Any) -> Generate:
    params = fields.pop("params", SamplingParams(max_tokens=12, ignore_eos=True))
    return Generate(
        fields.pop("token", TOKEN), request_id, fields.pop("ids", PROMPT), params, **fields
    )


def _digest(folder: Path, model_dir: Path) -> str:
    return load_peft_adapter(folder, BaseModelSpec.from_model_dir(model_dir)).digest


def _upload(gateway: Gateway, digest: str, folder: Path) -> ToGateway:
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    return gateway.call("register", digest=digest, config=config, weights=weights)


def _stats(gateway: Gateway) -> dict[str, Any]:
    reply = gateway.call("stats")
    assert isinstance(reply, Reply)
    return dict(reply.value)


def _wait_idle(gateway: Gateway) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = _stats(gateway)
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
    raise AssertionError(f"the engine never went idle: {stats}")


def _failed(received: list[ToGateway] | ToGateway) -> Failed:
    last = received[-1] if isinstance(received, list) else received
    assert isinstance(last, Failed), last
    return last


def test_generate_streams_token_id_deltas_ending_with_usage(gateway: Gateway) -> None:
    deltas = gateway.stream("nd-1")
    assert all(isinstance(d, Delta) and d.ref == "nd-1" for d in deltas)
    assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])  # type: ignore[union-attr]
    last = deltas[-1]
    assert isinstance(last, Delta) and last.finish_reason == "length" and last.usage is not None
    assert last.usage.completion_tokens == 12 == sum(len(d.token_ids) for d in deltas)  # type: ignore[union-attr]
    assert last.usage.prompt_tokens == len(PROMPT)


def test_a_step_s_deltas_for_one_gateway_cross_in_one_frame(gateway: Gateway) -> None:
    """Eight streams from one gateway: each frame the engine sends is a batch, most hold
    deltas of several streams (one send per step, not per request), and each stream's deltas
    still arrive whole and in order."""
    ids = [f"batch-{i}" for i in range(8)]
    for request_id in ids:
        gateway.send(_generate(request_id, params=SamplingParams(max_tokens=16, ignore_eos=True)))
    frames: list[list[ToGateway]] = []
    ended: set[str] = set()
    while ended != set(ids):
        assert gateway.socket.poll(60_000), "the engine did not answer"
        frames.append(decode_to_gateway(gateway.socket.recv()))
        ended |= {m.ref for m in frames[-1] if isinstance(m, Delta) and m.usage is not None}
    assert max(len({m.ref for m in frame}) for frame in frames) == 8  # a step's, together
    assert len(frames) < 8 * 16 / 4
    for request_id in ids:
        mine = [m for frame in frames for m in frame if m.ref == request_id]
        assert all(isinstance(m, Delta) for m in mine)
        assert [m.usage is not None for m in mine] == [False] * (len(mine) - 1) + [True]  # type: ignore[union-attr]
        assert sum(len(m.token_ids) for m in mine) == 16  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"ids": PROMPT * 110}, "prompt_too_long"),
        ({"adapter": "0" * 64}, "unknown_adapter"),
        ({"ids": [10**9]}, "invalid_request"),
        ({"ids": []}, "invalid_request"),
    ],
)
def test_typed_errors_come_before_any_delta(
    gateway: Gateway, fields: dict[str, Any], code: str
) -> None:
    failed = _failed(gateway.stream("err-1", **fields))
    assert (failed.ref, failed.call, failed.kind, failed.code) == ("err-1", False, "engine", code)


def test_a_malformed_or_hostile_message_is_dropped_or_refused_and_the_engine_serves_on(
    gateway: Gateway,
) -> None:
    """Junk is dropped; a message with the token that fails validation is refused as an invalid
    request (dropped, its gateway waited for a first output that never came)."""
    gateway.send(b"\xc1 not msgpack")
    gateway.send(msgspec.msgpack.encode(["generate", TOKEN, "x", [1], {"max_tokens": 0}]))
    gateway.send(msgspec.msgpack.encode(["generate", TOKEN, "y", [1], {"top_p": float("inf")}]))
    gateway.send(msgspec.msgpack.encode(["call", TOKEN, "c", "shutdown"]))
    refused = [_failed(gateway.receive()) for _ in range(3)]
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
    refused = _failed(gateway.receive())
    assert (refused.ref, refused.code) == ("h1", "unauthorized")
    gateway.send(msgspec.msgpack.encode(["generate", "guess", "h" * 257, [1], {}]))
    gateway.send(msgspec.msgpack.encode(["call", TOKEN, "ok", "info"]))
    answer = gateway.receive()  # an over-long id is dropped, never echoed
    assert isinstance(answer, Reply) and answer.ref == "ok", answer


def test_every_message_needs_the_token(gateway: Gateway, service: RunningEngineService) -> None:
    for wrong in ("", "guess", TOKEN + "x"):
        failed = _failed(gateway.call("info", token=wrong))
        assert (failed.call, failed.code) == (True, "unauthorized")
        assert _failed(gateway.stream("anon", token=wrong)).code == "unauthorized"
    assert httpx.get(f"{service.health_url}/health").status_code == 200  # needs none


def test_an_abort_without_the_token_changes_nothing(gateway: Gateway) -> None:
    gateway.send(_generate("kept", params=SamplingParams(max_tokens=40, ignore_eos=True)))
    gateway.send(Abort("guess", "kept"))
    received = [gateway.receive()]
    while not (isinstance(received[-1], Delta) and received[-1].finish_reason is not None):
        received.append(gateway.receive())
    assert isinstance(received[-1], Delta) and received[-1].finish_reason == "length"
    timings = received[-1].timings  # the engine's timestamps travel with the final delta
    assert timings is not None and timings.first_token is not None
    [refused] = [m for m in received if isinstance(m, Failed)]
    assert refused.code == "unauthorized"


def test_info_stats_and_metrics(gateway: Gateway, service: RunningEngineService) -> None:
    info = gateway.call("info")
    assert isinstance(info, Reply)
    assert info.value == {
        "model_name": "demo",
        "max_model_len": 512,
        "vocab_size": 4096,
        "wire": WIRE_VERSION,
    }
    stats = _wait_idle(gateway)
    assert stats["kv_blocks_total"] == stats["kv_blocks_free"] + stats["kv_blocks_used"] > 0
    metrics = httpx.get(f"{service.health_url}/metrics").text
    assert f"loramux_kv_cache_blocks {float(stats['kv_blocks_total'])}" in metrics
    assert "# TYPE loramux_generation_tokens_total counter" in metrics
    assert "loramux_lora_slots_pinned 0.0" in metrics  # idle: no request holds a slot


def test_uploaded_adapter_is_served_listed_then_retired(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    folder = demo_adapter_dirs[0]
    digest = _digest(folder, demo_model_dir)
    assert _upload(gateway, digest, folder) == Reply("call-register", digest)
    assert isinstance(_upload(gateway, digest, folder), Reply)  # idempotent
    listed = gateway.call("adapters")
    assert isinstance(listed, Reply) and digest in listed.value
    last = gateway.stream("ad-1", adapter=digest)[-1]
    assert isinstance(last, Delta) and last.finish_reason == "length"

    assert gateway.call("retire", digest=digest) == Reply("call-retire", True)
    listed = gateway.call("adapters")
    assert isinstance(listed, Reply) and digest not in listed.value
    assert _failed(gateway.stream("ad-2", adapter=digest)).code == "unknown_adapter"


def test_upload_with_a_digest_that_is_not_its_content_is_refused(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    claimed = _digest(demo_adapter_dirs[1], demo_model_dir)
    actual = _digest(demo_adapter_dirs[2], demo_model_dir)
    assert _failed(_upload(gateway, claimed, demo_adapter_dirs[2])).code == "invalid_request"
    served = gateway.call("adapters")
    assert isinstance(served, Reply) and claimed not in served.value and actual not in served.value
    assert _failed(_upload(gateway, "../../etc", demo_adapter_dirs[2])).code == "invalid_request"
    assert _failed(gateway.call("register", digest="1" * 64)).code == "invalid_request"


def test_a_broken_adapter_is_refused_with_its_adapter_code(
    gateway: Gateway, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / CONFIG_FILE).write_text('{"peft_type": "IA3"}')
    (folder / WEIGHTS_FILE).write_bytes((demo_adapter_dirs[0] / WEIGHTS_FILE).read_bytes())
    assert _failed(_upload(gateway, "1" * 64, folder)).kind == "adapter"


def test_a_gateway_that_goes_away_mid_stream_has_its_request_aborted(
    gateway: Gateway, service: RunningEngineService
) -> None:
    generated_before = _wait_idle(gateway)["generated_tokens"]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    leaving = Gateway(context, service.url)
    leaving.send(_generate("gone-1", params=SamplingParams(max_tokens=490, ignore_eos=True)))
    for _ in range(3):
        delta = leaving.receive()
        assert isinstance(delta, Delta) and delta.finish_reason is None
    context.destroy(linger=0)
    stats = _wait_idle(gateway)
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["generated_tokens"] - generated_before < 490  # aborted, not run to its end


def test_a_request_the_engine_cannot_compute_fails_alone_with_request_failed(
    gateway: Gateway,
    service: RunningEngineService,
    overflowing_adapter: Path,
    demo_model_dir: Path,
) -> None:
    digest = _digest(overflowing_adapter, demo_model_dir)
    assert isinstance(_upload(gateway, digest, overflowing_adapter), Reply)
    assert _failed(gateway.stream("nan-1", adapter=digest)).code == "request_failed"
    assert httpx.get(f"{service.health_url}/health").status_code == 200
    last = gateway.stream("after-nan")[-1]
    assert isinstance(last, Delta) and last.finish_reason == "length"
    assert _wait_idle(gateway)["kv_blocks_used"] == 0


def test_cache_salt_crosses_the_wire_and_scopes_prefix_reuse(gateway: Gateway) -> None:
    prompt = list(range(1000, 1040))  # 2 full blocks of 16 are reusable

    def cached(request_id: str, salt: str | None) -> int:
        params = SamplingParams(max_tokens=2)
        last = gateway.stream(request_id, ids=prompt, cache_salt=salt, params=params)[-1]
        assert isinstance(last, Delta) and last.usage is not None
        return last.usage.cached_tokens

    assert cached("salt-a1", "tenant-a") == 0
    assert cached("salt-b1", "tenant-b") == 0
    assert cached("salt-a2", "tenant-a") == 32
    assert cached("salt-none", None) == 0


def test_abort_ends_the_stream_with_usage_and_counts_in_stats(gateway: Gateway) -> None:
    aborted_before = _wait_idle(gateway)["aborted"]
    gateway.send(_generate("ab-1", params=SamplingParams(max_tokens=490, ignore_eos=True)))
    first = gateway.receive()
    assert isinstance(first, Delta) and first.finish_reason is None
    gateway.send(Abort(TOKEN, "ab-1"))
    received = [first, gateway.receive()]
    while isinstance(received[-1], Delta) and received[-1].finish_reason is None:
        received.append(gateway.receive())
    last = received[-1]
    assert isinstance(last, Delta) and last.finish_reason == "abort" and last.usage is not None
    assert last.usage.completion_tokens == sum(len(d.token_ids) for d in received) < 490  # type: ignore[union-attr]
    assert _wait_idle(gateway)["aborted"] == aborted_before + 1


def test_a_prefetch_hint_loads_a_known_adapter_and_is_never_answered(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    config = EngineConfig(
        model=demo_model_dir,
        max_model_len=512,
        kv_cache_bytes=16 << 20,
        max_loras=1,
        max_cpu_loras=1,
    )
    engine = AsyncEngine(LLMEngine(config))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with serve_engine_in_thread(engine, "demo", adapter_dir=tmp_path, token=TOKEN) as running:
        try:
            gateway = Gateway(context, running.url)
            cold, warm = demo_adapter_dirs[:2]
            digest = _digest(cold, demo_model_dir)
            assert isinstance(_upload(gateway, digest, cold), Reply)
            assert isinstance(_upload(gateway, _digest(warm, demo_model_dir), warm), Reply)
            lora = running.engine.engine.lora
            assert lora is not None and digest not in lora.resident(), "one host slot: evicted"

            gateway.send(Prefetch("wrong-token", digest))
            gateway.send(Prefetch(TOKEN, "f" * 64))  # registered nowhere
            gateway.send(encode(Prefetch(TOKEN, "f" * 10_000)))  # malformed: dropped
            assert isinstance(gateway.call("adapters"), Reply), "hints are never answered"
            assert digest not in lora.resident()

            gateway.send(Prefetch(TOKEN, digest))
            deadline = time.monotonic() + 30
            while lora.resident().get(digest) != "host":
                assert time.monotonic() < deadline, "the hinted adapter never loaded"
            assert running.engine.adapter_stats()[digest].hinted_loads == 1
            assert isinstance(gateway.call("stats"), Reply)
        finally:
            context.destroy(linger=0)


@pytest.fixture
def other_gateway(service: RunningEngineService) -> Iterator[Gateway]:
    with _gateway_at(service.url) as gateway:
        yield gateway


def test_only_the_gateway_that_started_a_request_can_abort_it(
    gateway: Gateway, other_gateway: Gateway
) -> None:
    """Another gateway with the token, knowing the request id, aborts nothing (each request is
    its gateway's); its own requests it aborts as before."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    gateway.send(_generate("mine", params=params))
    assert isinstance(gateway.receive(), Delta)
    other_gateway.send(Abort(TOKEN, "mine"))
    other_gateway.send(_generate("theirs", params=params))
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
                cut_off.send(_generate(f"cut-{i}", params=params))
            assert isinstance(cut_off.receive(), Delta)
            proxy.cut.set()
            stats = _wait_idle(gateway)
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

    monkeypatch.setattr(service_module.EngineServer, "__post_init__", small_buffers)
    config = EngineConfig(model=demo_model_dir, max_model_len=2048, kv_cache_bytes=96 << 20)
    engine = AsyncEngine(LLMEngine(config))
    with (
        serve_engine_in_thread(engine, "demo", token=TOKEN) as running,
        _gateway_at(running.url) as behind,
    ):
        behind.socket.setsockopt(zmq.RCVHWM, 1)
        behind.socket.setsockopt(zmq.RCVBUF, 2048)
        behind.socket.disconnect(running.url)  # the options apply to a new connection
        behind.socket.connect(running.url)
        params = SamplingParams(max_tokens=1500, ignore_eos=True)
        for i in range(2):
            behind.send(_generate(f"long-{i}", params=params))
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
