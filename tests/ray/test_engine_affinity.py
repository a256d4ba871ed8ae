"""Adapter-affinity multiplexing on Ray Serve: requests for one adapter keep landing on the
engine replica that holds it, and what they generate equals PEFT's."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from tests.ray.conftest import ENGINE_REPLICAS, RayEngines

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
    assert len(set(placed.values())) == ENGINE_REPLICAS, "adapters spread over every replica"

    more = [(a, 100 * a + r) for r in (1, 2) for a in range(len(digests))]
    got = await asyncio.gather(
        *(generate(ray_engines, f"r-{a}-{i}", digests[a], i) for a, i in more)
    )
    assert await holders(ray_engines) == placed
    counts = {
        d: n for s in await ray_engines.client.replica_stats(digests) for d, n in s.served.items()
    }
    assert counts == {d: 3 for d in digests}

    expected = peft_greedy(demo_model_dir, ray_engines.adapter_dirs, asks + more)
    assert got == expected[len(asks) :]
