"""loramux's engine on Ray Serve, three comparisons side by side in one run on a local Ray cluster:

- throughput: the same workload (requests over several adapters, all at once) through the
  engine deployment with 1, 2 and 3 replicas; tokens (prompt + output) per wall second and the
  ratio to 1 replica. On a machine with few cores the replicas share them, so the ratio is
  bounded by the cores: on 2 cores it says how much routing and the replicas' own overhead cost,
  not how loramux scales on one GPU per replica;
- routing overhead: p50 latency of a one-token request through a Ray Serve deployment handle
  (gateway.engine_client.ray) minus the same through the in-process engine client, one request
  at a time;
- prefix-cache hit tokens over 3 replicas with adapter-affinity routing (the adapter digest as
  the multiplexed model id) against Ray Serve's default routing with no model id (random among
  replicas), the same workload on fresh replicas: requests of one adapter share a long system
  prefix; the first request of each adapter runs, then the rest at once.

Run: `python -m bench.ray_serve [--quick]` (needs the `ray` extra).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from bench.common import Figure, Result, RunSettings, median, run_benchmark
from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.demo import build_demo_adapters
from loramux.adapters.store import AdapterStore
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.outputs import EngineRequest
from loramux.engine.ray_deployment import (
    BASE_MODEL_ID,
    EngineDeploymentOptions,
    ReplicaStats,
    engine_deployment,
)
from loramux.engine.sampling import SamplingParams
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.engine_client.local import LocalEngineClient
from loramux.gateway.engine_client.ray import RayEngineClient

NAME = "ray_serve"
REPLICA_COUNTS = (1, 2, 3)


@dataclass(frozen=True)
class Workload:
    adapters: int
    requests: int
    prefix_len: int
    """System-prefix tokens shared by the requests of one adapter."""
    tail_len: int
    output_tokens: int
    latency_samples: int
    seed: int = 0

    def requests_for(self, digests: Sequence[str]) -> list[EngineRequest]:
        rng = random.Random(self.seed)
        prefixes = [[rng.randrange(3, 2000) for _ in range(self.prefix_len)] for _ in digests]
        out = []
        for i in range(self.requests):
            a = i % len(digests)
            tail = [rng.randrange(3, 2000) for _ in range(self.tail_len)]
            params = SamplingParams(max_tokens=self.output_tokens, ignore_eos=True)
            out.append(
                EngineRequest(
                    f"w{i}", params, prompt_token_ids=prefixes[a] + tail, adapter=digests[a]
                )
            )
        return out


WORKLOADS = {
    "quick": Workload(
        adapters=6, requests=36, prefix_len=96, tail_len=8, output_tokens=8, latency_samples=30
    ),
    "full": Workload(
        adapters=12,
        requests=144,
        prefix_len=192,
        tail_len=16,
        output_tokens=32,
        latency_samples=200,
    ),
}


async def run_all(client: EngineClient, requests: Sequence[EngineRequest], tag: str) -> int:
    """Run every request at once; the tokens (prompt + output) they made."""

    async def one(r: EngineRequest) -> int:
        total = 0
        async for out in client.generate(
            EngineRequest(
                f"{tag}-{r.request_id}",
                r.params,
                prompt_token_ids=r.prompt_token_ids,
                adapter=r.adapter,
            )
        ):
            if out.usage is not None:
                total = out.usage.total_tokens
        return total

    return sum(await asyncio.gather(*(one(r) for r in requests)))


async def latencies(client: EngineClient, samples: int, tag: str) -> list[float]:
    times = []
    for i in range(samples):
        request = EngineRequest(
            f"{tag}-{i}", SamplingParams(max_tokens=1), prompt_token_ids=[5, 6, 7, 8]
        )
        start = time.perf_counter()
        async for _ in client.generate(request):
            pass
        times.append(time.perf_counter() - start)
    return times


def deploy(config: EngineConfig, store: AdapterStore, replicas: int) -> DeploymentHandle:
    serve.delete("bench-engine")
    options = EngineDeploymentOptions(num_replicas=replicas, num_cpus=0.5)
    app = engine_deployment(config, "demo", store.root, options)
    return serve.run(app, name="bench-engine", route_prefix=None)


async def every_replica(handle: DeploymentHandle, replicas: int) -> list[ReplicaStats]:
    """Stats of all `replicas`, asking until each has answered once."""
    found: dict[str, ReplicaStats] = {}
    deadline = time.monotonic() + 60
    while len(found) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(found)} of {replicas} replicas answered")
        for s in await asyncio.gather(*(handle.stats.remote() for _ in range(4 * replicas))):
            found[s.replica] = s
    return list(found.values())


async def prefix_hits(
    handle: DeploymentHandle,
    client: RayEngineClient,
    requests: Sequence[EngineRequest],
    replicas: int,
) -> dict[str, int]:
    before = sum(s.engine["prefix_cache_hit_tokens"] for s in await every_replica(handle, replicas))
    first = len({r.adapter for r in requests})  # the first request of each adapter, then the rest
    await run_all(client, requests[:first], "prefix-first")
    await run_all(client, requests[first:], "prefix-rest")
    after = await every_replica(handle, replicas)
    hits = sum(s.engine["prefix_cache_hit_tokens"] for s in after) - before
    return {
        "hit_tokens": hits,
        "prompt_tokens": sum(len(r.prompt_token_ids or []) for r in requests),
    }


async def measure(
    settings: RunSettings, model_dir: Path, workload: Workload, work: Path
) -> dict[str, Any]:
    store = AdapterStore(work / "store", BaseModelSpec.from_model_dir(model_dir))
    folders = build_demo_adapters(
        model_dir, work / "adapters", workload.adapters, seed=workload.seed
    )
    digests = [store.put(f).digest for f in folders]
    config = EngineConfig(model=model_dir, max_model_len=512, num_kv_blocks=512)
    requests = workload.requests_for(digests)
    out: dict[str, Any] = {"throughput": {}}
    for n in REPLICA_COUNTS:
        handle = deploy(config, store, n)
        client = RayEngineClient(handle)
        await run_all(client, requests[: workload.adapters], f"warm{n}")  # load every adapter
        start = time.perf_counter()
        tokens = await run_all(client, requests, f"t{n}")
        out["throughput"][n] = tokens / (time.perf_counter() - start)
        if n == 1:
            out["ray_latency"] = await latencies(client, workload.latency_samples, "lat")
        if n == 3:
            handle = deploy(config, store, n)  # cold caches for each routing
            out["affinity"] = await prefix_hits(handle, RayEngineClient(handle), requests, n)
            handle = deploy(config, store, n)
            out["random"] = await prefix_hits(
                handle, RayEngineClient(handle, affinity=False), requests, n
            )
    serve.delete("bench-engine")
    local = LocalEngineClient(AsyncEngine.from_config(config), "demo")
    await local.start()
    try:
        out["local_latency"] = await latencies(local, workload.latency_samples, "local")
    finally:
        await local.close()
    return out


def benchmark(settings: RunSettings, model_dir: Path, model: dict[str, Any]) -> Result:
    workload = WORKLOADS[settings.mode]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(proxy_location="Disabled")
        with tempfile.TemporaryDirectory() as work:
            m = asyncio.run(measure(settings, model_dir, workload, Path(work)))
    finally:
        serve.shutdown()
        ray.shutdown()
    tput = m["throughput"]
    ray_p50, local_p50 = median(m["ray_latency"]), median(m["local_latency"])
    figures = [
        *(
            Figure(f"throughput, {n} engine replica(s)", tput[n], "tokens/s")
            for n in REPLICA_COUNTS
        ),
        *(
            Figure(f"throughput ratio {n}/1 replicas", tput[n] / tput[1], "x")
            for n in REPLICA_COUNTS[1:]
        ),
        Figure(
            "routing overhead p50 (Ray handle - in-process)", 1000 * (ray_p50 - local_p50), "ms"
        ),
        Figure("prefix hit tokens, affinity routing", m["affinity"]["hit_tokens"], "tokens"),
        Figure("prefix hit tokens, random routing", m["random"]["hit_tokens"], "tokens"),
        Figure(
            "prefix hit tokens affinity / random",
            m["affinity"]["hit_tokens"] / max(1, m["random"]["hit_tokens"]),
            "x",
            goal_min=1.0,
        ),
    ]
    details = {
        "ray_p50_ms": 1000 * ray_p50,
        "local_p50_ms": 1000 * local_p50,
        "affinity": m["affinity"],
        "random": m["random"],
        "ray_version": ray.__version__,
        "replica_cpus": 0.5,
        "note": "replicas share the machine's cores: throughput ratios are bounded by them",
    }
    return Result(
        NAME, settings, model, asdict(workload), {"base_model_id": BASE_MODEL_ID}, figures, details
    )


def main(argv: Sequence[str] | None = None) -> Path:
    return run_benchmark(__doc__ or NAME, argv, benchmark)


if __name__ == "__main__":
    main()
