"""The engine's service: the ZeroMQ channel (streams of token-id deltas, typed errors before the
stream, adapter upload and retirement, the token on every message, aborts when a gateway goes
away) and its HTTP health and metrics endpoint. Spoken to here as a gateway would, message by
message (tests.engine.service_peer); hostile peers are test_service_hostile_peers's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.errors import FileTooLarge
from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter
from loramux.adapters.store import AdapterStore
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.errors import EngineOverloadedError
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.sampling import SamplingParams
from loramux.engine.service import serve_engine_in_thread
from loramux.engine.service.runner import RunningEngineService
from loramux.engine.service.upload_parts import MAX_GATEWAY_UPLOADS, UploadParts
from loramux.engine.service.uploads import MAX_ADAPTER_MB
from loramux.engine.service.wire import (
    WIRE_VERSION,
    Abort,
    Call,
    Delta,
    Prefetch,
    Reply,
    ToGateway,
    decode_to_gateway,
    encode,
)
from tests.engine import service_peer
from tests.engine.service_peer import (
    PROMPT,
    TOKEN,
    Gateway,
    failure_of,
    gateway_at,
    generate,
    wait_idle,
)

# The service and a gateway socket on it, as fixtures here (not in the engine conftest, which the
# GPU suite loads on an image without pyzmq or uvicorn).
service, gateway = service_peer.service, service_peer.gateway


def _digest(folder: Path, model_dir: Path) -> str:
    return load_peft_adapter(folder, BaseModelSpec.from_model_dir(model_dir)).digest


def _upload(gateway: Gateway, digest: str, folder: Path) -> ToGateway:
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    return gateway.upload(digest, config, weights)[-1]


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


def test_info_stats_and_metrics(gateway: Gateway, service: RunningEngineService) -> None:
    info = gateway.call("info")
    assert isinstance(info, Reply)
    assert info.value == {
        "model_name": "demo",
        "max_model_len": 512,
        "vocab_size": 4096,
        "wire": WIRE_VERSION,
        "max_adapter_bytes": MAX_ADAPTER_MB << 20,  # a gateway refuses larger adapters by it
    }
    stats = wait_idle(gateway)
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
    assert _upload(gateway, digest, folder) == Reply("call-register-part", digest)
    assert isinstance(_upload(gateway, digest, folder), Reply)  # idempotent
    listed = gateway.call("adapters")
    assert isinstance(listed, Reply) and digest in listed.value
    last = gateway.stream("ad-1", adapter=digest)[-1]
    assert isinstance(last, Delta) and last.finish_reason == "length"

    assert gateway.call("retire", digest=digest) == Reply("call-retire", True)
    listed = gateway.call("adapters")
    assert isinstance(listed, Reply) and digest not in listed.value
    assert failure_of(gateway.stream("ad-2", adapter=digest)).code == "unknown_adapter"


def test_upload_with_a_digest_that_is_not_its_content_is_refused(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    claimed = _digest(demo_adapter_dirs[1], demo_model_dir)
    actual = _digest(demo_adapter_dirs[2], demo_model_dir)
    assert failure_of(_upload(gateway, claimed, demo_adapter_dirs[2])).code == "invalid_request"
    served = gateway.call("adapters")
    assert isinstance(served, Reply) and claimed not in served.value and actual not in served.value
    assert failure_of(_upload(gateway, "../../etc", demo_adapter_dirs[2])).code == "invalid_request"
    assert failure_of(gateway.call("register-part", digest="1" * 64)).code == "invalid_request"


def test_a_broken_adapter_is_refused_with_its_adapter_code(
    gateway: Gateway, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / CONFIG_FILE).write_text('{"peft_type": "IA3"}')
    (folder / WEIGHTS_FILE).write_bytes((demo_adapter_dirs[0] / WEIGHTS_FILE).read_bytes())
    assert failure_of(_upload(gateway, "1" * 64, folder)).kind == "adapter"


def test_an_adapter_larger_than_a_part_arrives_in_parts_and_serves(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    """Each part is answered with the weights' bytes stored so far; the last with the digest,
    once the whole adapter is checked and served. No frame carries the whole adapter."""
    folder = demo_adapter_dirs[6]
    digest = _digest(folder, demo_model_dir)
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    part = 256 << 10
    assert len(weights) > 3 * part
    answers = gateway.upload(digest, config, weights, part_bytes=part)
    assert len(answers) == -(-len(weights) // part)
    assert [a.value for a in answers[:-1]] == list(range(part, len(weights), part))  # type: ignore[union-attr]
    assert answers[-1] == Reply("call-register-part", digest)
    last = gateway.stream("parts-1", adapter=digest)[-1]
    assert isinstance(last, Delta) and last.finish_reason == "length"


def test_adapter_parts_out_of_order_or_over_the_limit_are_refused(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    """A part that does not continue its upload ends it (invalid_request), a part with no
    upload under way is refused, and an adapter over the engine's limit is refused at its
    first part with the adapter code a gateway answers 413 for."""
    folder = demo_adapter_dirs[7]
    digest = _digest(folder, demo_model_dir)
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    fields = {"digest": digest, "size": len(weights)}
    first = gateway.call("register-part", config=config, weights=weights[:1000], **fields)
    assert first == Reply("call-register-part", 1000)
    skipped = gateway.call("register-part", weights=weights[2000:3000], offset=2000, **fields)
    assert failure_of(skipped).code == "invalid_request"
    resumed = gateway.call("register-part", weights=weights[1000:], offset=1000, **fields)
    assert failure_of(resumed).code == "invalid_request"  # the upload ended with the bad part
    too_large = {"digest": digest, "size": MAX_ADAPTER_MB << 20}
    refused = failure_of(gateway.call("register-part", config=config, weights=b"", **too_large))
    assert (refused.kind, refused.code) == ("adapter", "file_too_large")
    assert _upload(gateway, digest, folder) == Reply("call-register-part", digest)


async def test_uploads_under_way_are_bounded_and_dropped_once_abandoned(tmp_path: Path) -> None:
    """Parts wait on disk: the uploads under way together announce at most the engine's bound
    (past it a new one is refused as overloaded, so the gateway tries another engine), and one
    whose parts stop coming is dropped with its files, freeing its share."""
    parts = UploadParts(tmp_path, 1000, 1500, max_gateway_bytes=1500)
    parts.abandoned_seconds = 0.2
    assert await parts.receive(b"gw", "a", b"{}", b"x" * 100, 0, 900) is None
    with pytest.raises(EngineOverloadedError):
        await parts.receive(b"gw", "b", b"{}", b"y" * 100, 0, 900)
    with pytest.raises(FileTooLarge):
        await parts.receive(b"gw", "c", b"{}", b"", 0, 1000)
    assert len(list(tmp_path.iterdir())) == 1
    async with asyncio.timeout(10):
        while parts.reserved:  # the abandonment timer fires
            await asyncio.sleep(0.01)
    await parts.settled()
    assert list(tmp_path.iterdir()) == []
    whole = await parts.receive(b"gw", "b", b"{}", b"y" * 900, 0, 900)
    assert whole is not None and (whole / WEIGHTS_FILE).read_bytes() == b"y" * 900
    parts.finish("b")
    assert parts.reserved == 0
    parts.close()


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


def test_a_request_the_engine_cannot_compute_fails_alone_with_request_failed(
    gateway: Gateway,
    service: RunningEngineService,
    overflowing_adapter: Path,
    demo_model_dir: Path,
) -> None:
    digest = _digest(overflowing_adapter, demo_model_dir)
    assert isinstance(_upload(gateway, digest, overflowing_adapter), Reply)
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


def _stored(root: Path) -> list[str]:
    """The digests stored under an engine's adapter folder, whichever run stored them."""
    return sorted(p.name for p in root.glob("run-*/*") if len(p.name) == 64)


def test_uploaded_adapter_files_leave_the_engine_with_the_adapter(
    demo_adapter_dirs: list[Path], demo_model_dir: Path, tmp_path: Path
) -> None:
    """The engine's adapter folder is a cache of what gateways upload (they upload again
    whatever it lacks): a start removes what runs that are gone stored, and a retired
    adapter's files go once the engine drops it (its last request ended; here, the next
    step). Both used to stay for good, a deleted tenant's weights included. The same bytes
    uploaded again serve again."""
    folder = demo_adapter_dirs[1]
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    AdapterStore(tmp_path, base).put(demo_adapter_dirs[2])  # the earlier flat layout's
    dead = tmp_path / "run-1-dead"
    AdapterStore(dead, base).put(demo_adapter_dirs[3])
    (dead / ".alive").touch()  # nobody holds its lock: its process is gone
    engine = AsyncEngine(LLMEngine(EngineConfig(model=demo_model_dir, max_model_len=512)))
    with (
        serve_engine_in_thread(engine, "demo", adapter_dir=tmp_path, token=TOKEN) as running,
        gateway_at(running.url) as peer,
    ):
        assert _stored(tmp_path) == [] and AdapterStore(tmp_path, base).digests() == []
        digest = _digest(folder, demo_model_dir)
        assert _upload(peer, digest, folder) == Reply("call-register-part", digest)
        assert _stored(tmp_path) == [digest]
        assert isinstance(peer.stream("on-it", adapter=digest)[-1], Delta)
        assert peer.call("retire", digest=digest) == Reply("call-retire", True)
        peer.stream("next-step")  # the engine drops the retired adapter between steps
        deadline = time.monotonic() + 30
        while _stored(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _stored(tmp_path) == []
        assert _upload(peer, digest, folder) == Reply("call-register-part", digest)
        assert isinstance(peer.stream("again", adapter=digest)[-1], Delta)
    assert _stored(tmp_path) == [], "a run's folder goes with it"


def test_engines_sharing_an_adapter_folder_keep_each_other_s_files(
    demo_adapter_dirs: list[Path], demo_model_dir: Path, tmp_path: Path
) -> None:
    """Engines on one volume (one per GPU, as the compose file adds them) share the adapter
    folder. Another engine's start removed every adapter stored there, so this one's adapter,
    once out of its host tier, failed to load (found by attacking the fixes)."""
    config = EngineConfig(model=demo_model_dir, max_model_len=512, max_loras=1, max_cpu_loras=1)
    a, b = demo_adapter_dirs[4], demo_adapter_dirs[5]
    da, db = _digest(a, demo_model_dir), _digest(b, demo_model_dir)
    with (
        serve_engine_in_thread(
            AsyncEngine(LLMEngine(config)), "demo", adapter_dir=tmp_path, token=TOKEN
        ) as one,
        gateway_at(one.url) as peer,
    ):
        _upload(peer, da, a)
        _upload(peer, db, b)
        assert isinstance(peer.stream("b", adapter=db)[-1], Delta)  # `a` leaves the host tier
        engine = AsyncEngine(LLMEngine(config))
        with serve_engine_in_thread(engine, "demo", adapter_dir=tmp_path, token=TOKEN):
            assert _stored(tmp_path) == sorted([da, db])
        last = peer.stream("a", adapter=da)[-1]
        assert isinstance(last, Delta) and last.finish_reason == "length", last


def test_an_adapter_retired_mid_upload_is_never_registered(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    """A retire (its tenant deleted it) that lands while a gateway is uploading the digest
    cancels the upload: its next part is refused (no upload under way), and the digest is
    neither served nor kept. The upload used to register it with its last part, for good."""
    folder = demo_adapter_dirs[9]
    digest = _digest(folder, demo_model_dir)
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    fields = {"digest": digest, "size": len(weights)}
    first = gateway.call("register-part", config=config, weights=weights[:1000], **fields)
    assert first == Reply("call-register-part", 1000)
    assert gateway.call("retire", digest=digest) == Reply("call-retire", False)
    rest = gateway.call("register-part", weights=weights[1000:], offset=1000, **fields)
    assert failure_of(rest).code == "invalid_request"
    served = gateway.call("adapters")
    assert isinstance(served, Reply) and digest not in served.value


def test_a_second_gateway_uploading_a_digest_under_way_gets_it_served(
    gateway: Gateway,
    service: RunningEngineService,
    demo_adapter_dirs: list[Path],
    demo_model_dir: Path,
) -> None:
    """Two gateways missing one adapter (after an engine restart) upload it at once: the second
    one's first part waits for the first gateway's upload and is answered with the digest once
    it serves, having taken no share of the engine's bound; each used to upload it in full."""
    folder = demo_adapter_dirs[10]
    digest = _digest(folder, demo_model_dir)
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    fields = {"digest": digest, "size": len(weights)}
    first = gateway.call("register-part", config=config, weights=weights[:1000], **fields)
    assert first == Reply("call-register-part", 1000)
    with gateway_at(service.url) as second:
        second.send(
            Call(TOKEN, "second", "register-part", digest, config, weights[:1000], 0, len(weights))
        )
        rest = gateway.call("register-part", weights=weights[1000:], offset=1000, **fields)
        assert rest == Reply("call-register-part", digest)
        assert second.receive() == Reply("second", digest)


def test_uploads_under_way_are_bounded_in_number_per_gateway(
    gateway: Gateway, service: RunningEngineService
) -> None:
    """The bound on uploads under way was on the bytes they announce only: tiny uploads (a
    byte announced, none sent) were each taken, a folder and a timer kept a minute, without
    bound. A gateway has at most MAX_GATEWAY_UPLOADS under way; past them it is refused as
    overloaded (so it tries another engine), and another gateway is not."""
    digests = [f"{i:064x}" for i in range(MAX_GATEWAY_UPLOADS + 1)]
    fields: dict[str, Any] = {"config": b"{}", "weights": b"", "offset": 0, "size": 1}
    for digest in digests[:-1]:
        assert gateway.call("register-part", digest=digest, **fields) == Reply(
            "call-register-part", 0
        )
    refused = gateway.call("register-part", digest=digests[-1], **fields)
    assert failure_of(refused).code == "engine_overloaded"
    with gateway_at(service.url) as other:
        taken = other.call("register-part", digest=digests[-1], **fields)
        assert taken == Reply("call-register-part", 0)
        assert other.call("abort-upload", digest=digests[-1]) == Reply("call-abort-upload", True)
    for digest in digests[:-1]:
        assert gateway.call("abort-upload", digest=digest) == Reply("call-abort-upload", True)
