"""The engine's service: the ZeroMQ channel (streams of token-id deltas, typed errors before the
stream, the token on every message, aborts when a gateway goes away) and its HTTP health and
metrics endpoint. Spoken to here as a gateway would, message by message
(tests.engine.service_peer); hostile peers are test_service_hostile_peers's, adapters
test_service_adapters's."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from loramux.engine import async_engine
from loramux.engine.identity import engine_build, model_identity
from loramux.engine.sampling import SamplingParams
from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.uploads import MAX_ADAPTER_MB
from loramux.engine.service.wire import (
    WIRE_VERSION,
    Abort,
    Delta,
    Reply,
    ToGateway,
    decode_to_gateway,
)
from tests.engine import service_peer
from tests.engine.service_peer import (
    PROMPT,
    TOKEN,
    Gateway,
    adapter_digest,
    failure_of,
    generate,
    upload_folder,
    wait_idle,
)

# The service and a gateway socket on it, as fixtures here (not in the engine conftest, which the
# GPU suite loads on an image without pyzmq or uvicorn).
service, gateway = service_peer.service, service_peer.gateway


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
        gateway.send(generate(request_id, params=SamplingParams(max_tokens=16, ignore_eos=True)))
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
    failed = failure_of(gateway.stream("err-1", **fields))
    assert (failed.ref, failed.call, failed.kind, failed.code) == ("err-1", False, "engine", code)


def test_info_stats_and_metrics(
    gateway: Gateway, service: RunningEngineService, demo_model_dir: Path
) -> None:
    info = gateway.call("info")
    assert isinstance(info, Reply)
    assert info.value == {
        "model_name": "demo",
        "max_model_len": 512,
        "vocab_size": 4096,
        "wire": WIRE_VERSION,
        "model_identity": model_identity(demo_model_dir, "float32"),  # of the files it serves
        "build": engine_build(),
        "max_adapter_bytes": MAX_ADAPTER_MB << 20,  # a gateway refuses larger adapters by it
    }
    stats = wait_idle(gateway)
    assert stats["kv_blocks_total"] == stats["kv_blocks_free"] + stats["kv_blocks_used"] > 0
    metrics = httpx.get(f"{service.health_url}/metrics").text
    assert f"loramux_kv_cache_blocks {float(stats['kv_blocks_total'])}" in metrics
    assert "# TYPE loramux_generation_tokens_total counter" in metrics
    assert "loramux_lora_slots_pinned 0.0" in metrics  # idle: no request holds a slot


def test_a_gateway_that_goes_away_mid_stream_has_its_request_aborted(
    gateway: Gateway, service: RunningEngineService
) -> None:
    generated_before = wait_idle(gateway)["generated_tokens"]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    leaving = Gateway(context, service.url)
    leaving.send(generate("gone-1", params=SamplingParams(max_tokens=490, ignore_eos=True)))
    for _ in range(3):
        delta = leaving.receive()
        assert isinstance(delta, Delta) and delta.finish_reason is None
    context.destroy(linger=0)
    stats = wait_idle(gateway)
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["generated_tokens"] - generated_before < 490  # aborted, not run to its end


def test_health_says_stalled_while_one_step_takes_too_long(
    gateway: Gateway, service: RunningEngineService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step thread stuck in one step (a deadlock, a hung device) kept /health at 200, so
    nothing ever restarted the engine. It says 503 `stalled` while stuck (and refuses the stats
    call gateways probe it with), and 200 again once the step ends. The stuck step is the real one, held at its start until released (the
    fault injected; what it computes is untouched)."""
    monkeypatch.setattr(async_engine, "STALL_SECONDS", 0.2)
    url, release, real_step = (
        f"{service.health_url}/health",
        threading.Event(),
        service.engine.engine.step,
    )

    def stuck_step() -> Any:
        release.wait(60)
        return real_step()

    monkeypatch.setattr(service.engine.engine, "step", stuck_step)
    gateway.send(generate("stalled-1"))
    deadline = time.monotonic() + 30
    while (answer := httpx.get(url)).status_code == 200:
        assert time.monotonic() < deadline, "health never said the step stalled"
        time.sleep(0.05)
    assert answer.status_code == 503 and answer.json() == {"status": "stalled"}
    # What gateways probe says the same: the stats call is refused while the step is stuck.
    refused = failure_of(gateway.call("stats"))
    assert (refused.code, refused.message) == (
        "engine_stopped",
        "the engine's step loop is stalled",
    )
    release.set()
    received = [gateway.receive()]
    while isinstance(received[-1], Delta) and received[-1].finish_reason is None:
        received.append(gateway.receive())
    assert received[-1].finish_reason == "length"  # type: ignore[union-attr]
    assert httpx.get(url).json() == {"status": "ok"}
    assert isinstance(gateway.call("stats"), Reply)


def test_a_request_the_engine_cannot_compute_fails_alone_with_request_failed(
    gateway: Gateway,
    service: RunningEngineService,
    overflowing_adapter: Path,
    demo_model_dir: Path,
) -> None:
    digest = adapter_digest(overflowing_adapter, demo_model_dir)
    assert isinstance(upload_folder(gateway, digest, overflowing_adapter), Reply)
    assert failure_of(gateway.stream("nan-1", adapter=digest)).code == "request_failed"
    assert httpx.get(f"{service.health_url}/health").status_code == 200
    last = gateway.stream("after-nan")[-1]
    assert isinstance(last, Delta) and last.finish_reason == "length"
    assert wait_idle(gateway)["kv_blocks_used"] == 0


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
    aborted_before = wait_idle(gateway)["aborted"]
    gateway.send(generate("ab-1", params=SamplingParams(max_tokens=490, ignore_eos=True)))
    first = gateway.receive()
    assert isinstance(first, Delta) and first.finish_reason is None
    gateway.send(Abort(TOKEN, "ab-1"))
    received = [first, gateway.receive()]
    while isinstance(received[-1], Delta) and received[-1].finish_reason is None:
        received.append(gateway.receive())
    last = received[-1]
    assert isinstance(last, Delta) and last.finish_reason == "abort" and last.usage is not None
    assert last.usage.completion_tokens == sum(len(d.token_ids) for d in received) < 490  # type: ignore[union-attr]
    assert wait_idle(gateway)["aborted"] == aborted_before + 1
