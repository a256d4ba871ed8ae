"""The engine on Ray Serve: requests for one adapter keep landing on the replica that holds it
and equal PEFT's, replicas load adapters they never saw from the shared store, a replica's own
adapter folder loses what the shared store deleted and goes with the replica, and a replica
killed mid-stream ends its streams cleanly and is brought back."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import random
import secrets
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.store import AdapterStore
from loramux.engine.config import EngineConfig
from loramux.engine.errors import EngineStoppedError, InvalidRequestError, UnknownAdapterError
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.ray_deployment import (
    REPLICA_ADAPTERS,
    EngineDeploymentOptions,
    engine_deployment,
)
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import FinishReason
from loramux.gateway.adapters.shared_store import SharedAdapterStore
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.engine_client.ray import RayEngineClient
from tests.ray.conftest import ENGINE_REPLICAS, RayEngines, serve

pytestmark = pytest.mark.ray

MAX_TOKENS = 6


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 24))]


async def generate(engines: RayEngines, request_id: str, digest: str, i: int) -> list[int]:
    request = EngineRequest(
        request_id,
        SamplingParams(max_tokens=MAX_TOKENS),
        prompt_token_ids=prompt(i),
        adapter=digest,
    )
    outputs: list[RequestOutput] = [o async for o in engines.client.generate(request)]
    assert outputs[-1].usage is not None
    return [t for o in outputs for t in o.token_ids]


def peft_greedy(
    model_dir: Path, folders: list[Path], asks: list[tuple[int, int]]
) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model: Any = PeftModel.from_pretrained(base, folders[0], adapter_name="a0")
    for n, folder in enumerate(folders[1:], start=1):
        model.load_adapter(folder, adapter_name=f"a{n}")
    model.eval()
    answers = []
    with torch.inference_mode():
        for adapter, i in asks:
            ids = prompt(i)
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                adapter_names=[f"a{adapter}"],
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            answers.append(out[0, len(ids) :].tolist())
    return answers


async def holders(engines: RayEngines) -> dict[str, str]:
    """Each adapter digest → the replica that served it (asserting there is only one)."""
    found: dict[str, str] = {}
    for replica in await engines.client.replica_stats(engines.digests):
        for digest in replica.served:
            assert digest not in found, f"{digest} was served by two replicas"
            found[digest] = replica.replica
    return found


async def routing_settled(engines: RayEngines, deadline: float) -> None:
    """Wait until a call naming each adapter reaches the replica that loaded it: replicas push
    the ids they hold to Ray Serve's routers every 0.1 s."""
    while time.monotonic() < deadline:
        held = await holders(engines)
        reached = await asyncio.gather(
            *(engines.client.replica_stats([d]) for d in engines.digests)
        )
        if all(
            any(s.replica == held[d] and d in s.served for s in stats)
            for d, stats in zip(engines.digests, reached, strict=True)
        ):
            return
    raise AssertionError("routers never learned which replica holds which adapter")


async def test_requests_for_an_adapter_keep_landing_on_its_replica_and_equal_peft(
    ray_engines: RayEngines, demo_model_dir: Path
) -> None:
    digests = ray_engines.digests
    asks = [(a, 100 * a) for a in range(len(digests))]
    for a, i in asks:  # one at a time: Ray Serve places each adapter on one replica
        await generate(ray_engines, f"warm-{a}", digests[a], i)
    await routing_settled(ray_engines, time.monotonic() + 60)
    placed = await holders(ray_engines)
    # Ray Serve picks a replica at random for an adapter nobody holds: 12 adapters land on
    # one replica with chance 3 / 3**12, on at most two with chance about 2% (too flaky to ask).
    assert len(set(placed.values())) >= 2, "adapters spread over the replicas"

    more = [(a, 100 * a + r) for r in (1, 2) for a in range(len(digests))]
    # One at a time: a request finding its adapter's replica busy may be sent to another
    # replica, which then loads the adapter too (Ray Serve's fallback, by design); on a loaded
    # two-core machine a queue probe alone can take long enough for that.
    got = [await generate(ray_engines, f"r-{a}-{i}", digests[a], i) for a, i in more]
    assert await holders(ray_engines) == placed
    counts = {
        d: n for s in await ray_engines.client.replica_stats(digests) for d, n in s.served.items()
    }
    assert counts == {d: 3 for d in digests}

    expected = peft_greedy(demo_model_dir, ray_engines.adapter_dirs, asks + more)
    assert got == expected[len(asks) :]


async def test_stats_and_metrics_reach_every_replica_each_under_its_own_label(
    ray_engines: RayEngines,
) -> None:
    """Bug: `stats` and `metrics` were one handle call, which reaches one replica: the
    dashboard showed one of three, and /metrics labelled whichever answered engine="0", so its
    counters jumped between replicas' values (going down) and the others' tokens were missing.
    Now both ask every replica (Ray Serve's broadcast), metrics by replica id."""
    engines = ray_engines
    await asyncio.gather(
        *(generate(engines, f"every-{i}", d, i) for i, d in enumerate(engines.digests))
    )
    assert len(set((await holders(engines)).values())) > 1  # more than one replica worked
    stats = await engines.client.stats()
    texts = await engines.client.metrics()
    assert len(stats) == ENGINE_REPLICAS and all(s is not None for s in stats)
    replicas = {s.replica for s in await engines.client.replica_stats(engines.digests)}
    assert set(texts) == replicas and len(replicas) == ENGINE_REPLICAS
    generated = sum(
        s.value
        for text in texts.values()
        for f in text_string_to_metric_families(text or "")
        if f.name == "loramux_generation_tokens"
        for s in f.samples
        if s.name == "loramux_generation_tokens_total"
    )
    assert generated == sum(s.generated_tokens for s in stats if s is not None)
    assert sum(1 for s in stats if s is not None and s.generated_tokens) > 1


async def test_a_replica_serves_an_adapter_stored_after_it_started(
    ray_engines: RayEngines, demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    folder = demo_adapter_dirs[len(ray_engines.digests)]
    digest = ray_engines.store.put(folder).digest  # as a gateway's upload does; no replica told
    got = await generate(ray_engines, "late", digest, 7)
    assert got == peft_greedy(demo_model_dir, [folder], [(0, 7)])[0]


async def test_an_unknown_adapter_or_a_text_prompt_is_refused_before_any_output(
    ray_engines: RayEngines,
) -> None:
    unknown = EngineRequest("unknown", prompt_token_ids=[5, 6], adapter="ab" * 32)
    with pytest.raises(UnknownAdapterError):
        [o async for o in ray_engines.client.generate(unknown)]
    text = EngineRequest("text", prompt="hi", adapter=ray_engines.digests[0])
    with pytest.raises(InvalidRequestError):
        [o async for o in ray_engines.client.generate(text)]
    assert len(await generate(ray_engines, "after-refusals", ray_engines.digests[0], 1)) == 6


async def test_an_aborted_stream_ends_with_an_abort_output_that_counts_what_it_delivered(
    ray_engines: RayEngines,
) -> None:
    request = EngineRequest(
        "to-abort",
        SamplingParams(max_tokens=400, ignore_eos=True),
        prompt_token_ids=prompt(3),
        adapter=ray_engines.digests[1],
    )
    outputs: list[RequestOutput] = []
    async for out in ray_engines.client.generate(request):
        if not outputs:
            await ray_engines.client.abort("to-abort")
        outputs.append(out)
    last = outputs[-1]
    assert last.finish_reason == FinishReason.ABORT and last.usage is not None
    assert last.usage.completion_tokens == sum(len(o.token_ids) for o in outputs) < 400


async def test_an_abort_asked_before_the_first_output_ends_the_stream_after_it(
    ray_engines: RayEngines,
) -> None:
    request = EngineRequest(
        "abort-early",
        SamplingParams(max_tokens=400, ignore_eos=True),
        prompt_token_ids=prompt(4),
        adapter=ray_engines.digests[2],
    )
    outputs = ray_engines.client.generate(request)
    first = asyncio.ensure_future(anext(outputs))
    await asyncio.sleep(0)  # let the request leave for a replica: abort must find it opening
    await ray_engines.client.abort("abort-early")
    delivered = [await first] + [o async for o in outputs]
    last = delivered[-1]
    assert last.finish_reason == FinishReason.ABORT and last.usage is not None
    assert last.usage.completion_tokens < 400


async def stream(
    engines: RayEngines, digest: str, i: int, started: set[int]
) -> RequestOutput | EngineStoppedError:
    """The stream's last output, or the error that ended it."""
    request = EngineRequest(
        f"long-{i}",
        SamplingParams(max_tokens=400, ignore_eos=True),
        prompt_token_ids=prompt(i),
        adapter=digest,
    )
    last: RequestOutput | None = None
    try:
        async for out in engines.client.generate(request):
            started.add(i)
            last = out
    except EngineStoppedError as exc:
        return exc
    assert last is not None
    return last


async def poll(condition: Any, what: str, seconds: float = 120) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found := await condition():
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stored_digests(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if len(p.name) == 64)


async def test_a_replicas_own_adapter_folder_loses_deleted_adapters_and_leaves_with_it(
    ray_engines: RayEngines, demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    """With the shared store (the database), a replica fetches adapters into a folder of its
    own. An adapter deleted from the shared store leaves that folder within seconds although no
    replica is told (it used to stay for good, a deleted tenant's weights included); the same
    bytes stored again serve again from the replica that still counts them as loaded. The
    folder goes when Ray Serve stops the replica, and a starting replica removes the folders of
    replicas killed outright, the one Ray Serve replaces included (they piled up in the
    temporary folder)."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    await asyncio.to_thread(upgrade, url)
    shared = SharedAdapterStore.from_url(url)
    kept, gone = ray_engines.digests[:2]
    for digest in (kept, gone):
        stored = ray_engines.store.get(digest)
        assert stored is not None
        await shared.put(stored)
    root = Path(tempfile.gettempdir()) / REPLICA_ADAPTERS
    dead = root / f"run-1-{secrets.token_hex(4)}"  # a replica killed outright: lock free
    AdapterStore(dead, BaseModelSpec.from_model_dir(demo_model_dir)).put(demo_adapter_dirs[3])
    (dead / ".alive").touch()
    config = EngineConfig(model=demo_model_dir, max_model_len=512, num_kv_blocks=256)
    options = EngineDeploymentOptions(num_replicas=1, num_cpus=0.5)
    source = functools.partial(SharedAdapterStore.from_url, url)
    app: Any = engine_deployment(config, "demo", tmp_path / "not-shared", options, source)
    try:
        handle = serve.run(app, name="own-folder", route_prefix=None)
        engines = dataclasses.replace(ray_engines, client=RayEngineClient(handle))
        for i, digest in enumerate((kept, gone)):
            assert len(await generate(engines, f"own-{i}", digest, i)) == MAX_TOKENS
        (stats,) = await engines.client.replica_stats()
        folder = Path(stats.adapter_root)
        assert folder.parent == root and not dead.exists()
        assert stored_digests(folder) == sorted([kept, gone])

        await shared.delete(gone)  # as the delete of its last live version does
        await poll(lambda: _true(gone not in stored_digests(folder)), "the copy to go", 60)
        assert stored_digests(folder) == [kept]
        stored = ray_engines.store.get(gone)
        assert stored is not None
        await shared.put(stored)  # the same bytes uploaded again
        assert len(await generate(engines, "again", gone, 2)) == MAX_TOKENS
        assert stored_digests(folder) == sorted([kept, gone])

        os.kill(stats.pid, signal.SIGKILL)  # killed outright: its folder stays until...

        async def replaced() -> list[Any]:
            now = await engines.client.replica_stats()
            return [s for s in now if s.pid != stats.pid]

        (restarted,) = await poll(replaced, "Ray Serve to bring the replica back")
        assert not folder.exists()  # ...the next replica on the host starts
        folder = Path(restarted.adapter_root)
        assert folder.parent == root and folder.exists()

        serve.delete("own-folder")  # blocks until the replica stopped
        assert not folder.exists()
    finally:
        serve.delete("own-folder")
        await shared.close()


async def test_killing_a_replica_mid_stream_ends_its_streams_cleanly_and_ray_restarts_it(
    ray_engines: RayEngines,
) -> None:
    client, digests = ray_engines.client, ray_engines.digests
    for a, d in enumerate(digests):  # every adapter placed on a replica before the streams
        await generate(ray_engines, f"place-{a}", d, a)
    replicas = await client.replica_stats(digests)
    victim = max(replicas, key=lambda s: len(s.served))
    started: set[int] = set()
    streams = [
        asyncio.ensure_future(stream(ray_engines, d, i, started)) for i, d in enumerate(digests)
    ]
    await poll(lambda: _true(len(started) == len(digests)), "every stream's first output")
    os.kill(victim.pid, signal.SIGKILL)

    ends = await asyncio.wait_for(asyncio.gather(*streams), 300)  # no client hangs
    cut = [e for e in ends if isinstance(e, EngineStoppedError)]
    done = [e for e in ends if isinstance(e, RequestOutput)]
    assert len(cut) + len(done) == len(digests)
    assert cut, "the killed replica's streams end with a clean error"
    assert all(o.usage is not None and o.usage.completion_tokens == 400 for o in done)

    async def replaced() -> bool:
        now = await client.replica_stats(digests)
        return len(now) == ENGINE_REPLICAS and victim.pid not in {s.pid for s in now}

    await poll(replaced, "Ray Serve to bring the replica back")
    lost = [d for d in victim.served if d in digests]
    for n, d in enumerate(lost):  # its adapters load again wherever Ray Serve sends them
        assert len(await generate(ray_engines, f"after-{n}", d, n)) == MAX_TOKENS


async def _true(value: bool) -> bool:
    return value


async def test_one_choice_aborted_alone_stops_there_while_the_others_go_on(
    ray_engines: RayEngines,
) -> None:
    """As with the local engine: a stop string ends choice 1 at the gateway, which aborts that
    choice alone. Its sequence ends on the replica that runs it (it used to run on to max_tokens
    and be billed for them all), the other choices run to their end, and the usage counts what
    was generated, no more. Three requests for adapters on (most likely) different replicas: an
    abort sent to any replica would find the right one in all three by chance once in 27."""
    for a in (3, 4, 5):
        outputs = await abort_choice_1(ray_engines, f"one-choice-{a}", ray_engines.digests[a])
        ends = {o.index: o.finish_reason for o in outputs if o.finish_reason is not None}
        assert ends == {0: FinishReason.LENGTH, 1: FinishReason.ABORT, 2: FinishReason.LENGTH}
        tokens = {i: sum(len(o.token_ids) for o in outputs if o.index == i) for i in range(3)}
        assert tokens[0] == tokens[2] == 100 and tokens[1] < 100
        usage = outputs[-1].usage
        assert usage is not None and usage.completion_tokens == sum(tokens.values())


async def abort_choice_1(engines: RayEngines, request_id: str, digest: str) -> list[RequestOutput]:
    """The outputs of a request for 3 choices whose choice 1 is aborted at its first token."""
    request = EngineRequest(
        request_id,
        SamplingParams(max_tokens=100, n=3, temperature=1.0, seed=3, ignore_eos=True),
        prompt_token_ids=prompt(5),
        adapter=digest,
    )
    outputs: list[RequestOutput] = []
    async for out in engines.client.generate(request):
        if out.index == 1 and out.token_ids and not any(o.index == 1 for o in outputs):
            await engines.client.abort(request_id, choice=1)
        outputs.append(out)
    return outputs
