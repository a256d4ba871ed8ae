"""The engine service's adapters, spoken to as a gateway would (tests.engine.service_peer):
uploads in parts (checked against their digest, bounded in number, dropped once abandoned or
retired mid-upload, shared by gateways uploading one digest), prefetch hints, and the files
an adapter leaves on disk."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.errors import FileTooLarge
from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
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
    Call,
    Delta,
    Failed,
    Prefetch,
    Reply,
    ToGateway,
    encode,
)
from loramux.engine.structured import StructuredOutput
from tests.engine import service_peer
from tests.engine.service_peer import (
    TOKEN,
    Gateway,
    adapter_digest,
    failure_of,
    gateway_at,
    generate,
    stats_of,
    upload_folder,
)

# The service and a gateway socket on it, as fixtures here (not in the engine conftest, which the
# GPU suite loads on an image without pyzmq or uvicorn).
service, gateway = service_peer.service, service_peer.gateway


def test_uploaded_adapter_is_served_listed_then_retired(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    folder = demo_adapter_dirs[0]
    digest = adapter_digest(folder, demo_model_dir)
    assert upload_folder(gateway, digest, folder) == Reply("call-register-part", digest)
    assert isinstance(upload_folder(gateway, digest, folder), Reply)  # idempotent
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
    claimed = adapter_digest(demo_adapter_dirs[1], demo_model_dir)
    actual = adapter_digest(demo_adapter_dirs[2], demo_model_dir)
    assert (
        failure_of(upload_folder(gateway, claimed, demo_adapter_dirs[2])).code == "invalid_request"
    )
    served = gateway.call("adapters")
    assert isinstance(served, Reply) and claimed not in served.value and actual not in served.value
    assert (
        failure_of(upload_folder(gateway, "../../etc", demo_adapter_dirs[2])).code
        == "invalid_request"
    )
    assert failure_of(gateway.call("register-part", digest="1" * 64)).code == "invalid_request"


def test_a_broken_adapter_is_refused_with_its_adapter_code(
    gateway: Gateway, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / CONFIG_FILE).write_text('{"peft_type": "IA3"}')
    (folder / WEIGHTS_FILE).write_bytes((demo_adapter_dirs[0] / WEIGHTS_FILE).read_bytes())
    assert failure_of(upload_folder(gateway, "1" * 64, folder)).kind == "adapter"


def test_an_adapter_larger_than_a_part_arrives_in_parts_and_serves(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    """Each part is answered with the weights' bytes stored so far; the last with the digest,
    once the whole adapter is checked and served. No frame carries the whole adapter."""
    folder = demo_adapter_dirs[6]
    digest = adapter_digest(folder, demo_model_dir)
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
    digest = adapter_digest(folder, demo_model_dir)
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
    assert upload_folder(gateway, digest, folder) == Reply("call-register-part", digest)


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
            digest = adapter_digest(cold, demo_model_dir)
            assert isinstance(upload_folder(gateway, digest, cold), Reply)
            assert isinstance(
                upload_folder(gateway, adapter_digest(warm, demo_model_dir), warm), Reply
            )
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
        digest = adapter_digest(folder, demo_model_dir)
        assert upload_folder(peer, digest, folder) == Reply("call-register-part", digest)
        assert _stored(tmp_path) == [digest]
        assert isinstance(peer.stream("on-it", adapter=digest)[-1], Delta)
        assert peer.call("retire", digest=digest) == Reply("call-retire", True)
        peer.stream("next-step")  # the engine drops the retired adapter between steps
        deadline = time.monotonic() + 30
        while _stored(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _stored(tmp_path) == []
        assert upload_folder(peer, digest, folder) == Reply("call-register-part", digest)
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
    da, db = adapter_digest(a, demo_model_dir), adapter_digest(b, demo_model_dir)
    with (
        serve_engine_in_thread(
            AsyncEngine(LLMEngine(config)), "demo", adapter_dir=tmp_path, token=TOKEN
        ) as one,
        gateway_at(one.url) as peer,
    ):
        upload_folder(peer, da, a)
        upload_folder(peer, db, b)
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
    digest = adapter_digest(folder, demo_model_dir)
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
    digest = adapter_digest(folder, demo_model_dir)
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


def test_an_adapter_retired_while_a_request_for_it_is_checked_ends_the_request(
    gateway: Gateway, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    """A structured request's schema is compiled off the step thread after its adapter was
    found servable; a retire landing meanwhile drops the adapter (no request uses it yet). The
    request then ends, refused as unknown_adapter (a gateway uploads the adapter again, or
    answers 404 once it was deleted), or served had it been queued first; it never waits for
    an adapter the engine no longer has, with the step loop spinning."""
    folder = demo_adapter_dirs[11]
    digest = adapter_digest(folder, demo_model_dir)
    assert isinstance(upload_folder(gateway, digest, folder), Reply)
    # An enum of 5,000 strings, a schema not compiled before: about half a second to compile.
    values = [f"retire{i}_{i * 7}" for i in range(5000)]
    schema = {"type": "object", "properties": {"a": {"enum": values}}, "required": ["a"]}
    structured = StructuredOutput("json_schema", json.dumps(schema))
    params = SamplingParams(max_tokens=8, structured=structured)
    gateway.send(generate("retired-mid-check", adapter=digest, params=params))
    # A round trip: the service has handed the request's check to a thread (which finds the
    # adapter servable, then compiles the schema) before the retire arrives.
    assert isinstance(gateway.call("info"), Reply)
    gateway.send(Call(TOKEN, "call-retire", "retire", digest=digest))
    retired = Reply("call-retire", True)
    received: list[ToGateway] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (_last(received) and retired in received):
        if gateway.unread or gateway.socket.poll(500):
            received.append(gateway.receive())
    assert retired in received
    last = _last(received)
    assert last is not None, f"the request never ended: {stats_of(gateway)}"
    assert isinstance(last, Delta) or last.code == "unknown_adapter", last
    stats = stats_of(gateway)
    assert (stats["waiting"], stats["running"], stats["kv_blocks_used"]) == (0, 0, 0), stats


def _last(received: list[ToGateway]) -> Delta | Failed | None:
    """The request's last message (a Failed, or the Delta with its usage), if it came."""
    ends = [m for m in received if isinstance(m, Failed) or (isinstance(m, Delta) and m.usage)]
    return ends[0] if ends else None
