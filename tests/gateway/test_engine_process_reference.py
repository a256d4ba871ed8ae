"""Through the process split, the engine's greedy output is still the reference: a real
`loramux engine` process, spoken to by the gateway's ZeroMQ client, equals transformers for the
base model and PEFT for adapters, with a dozen requests arriving at once into a KV pool small
enough to force preemption and a step budget small enough to chunk every long prompt."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.peft_format import load_peft_adapter
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.gateway.engine_client.remote import RemoteEngineClient
from tests.engine.conftest import hf_greedy
from tests.engine.test_multi_lora import peft_greedy
from tests.gateway.engine_process import engine_process

TOKEN = "reference-engine-token"
MAX_TOKENS = 16
LENGTHS = [5, 17, 33, 48, 64, 80, 96, 110, 127, 140, 150, 160]
"""~1,030 prompt tokens; the pool holds 512 (1 MiB of 32 KiB blocks), the step budget 64."""
SMALL_ENGINE = {
    "LORAMUX_MAX_MODEL_LEN": "512",
    "LORAMUX_KV_CACHE_MB": "1",
    "LORAMUX_MAX_BATCHED_TOKENS": "64",
    "LORAMUX_MAX_NUM_SEQS": "16",
    "LORAMUX_ENGINE_THREADS": "1",
}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in LENGTHS]


async def _generate_all(
    client: RemoteEngineClient, requests: list[EngineRequest]
) -> dict[str, list[int]]:
    async def one(request: EngineRequest) -> list[int]:
        return [t async for out in client.generate(request) for t in out.token_ids]

    async with asyncio.timeout(120):
        answers = await asyncio.gather(*(one(r) for r in requests))
    return {r.request_id: tokens for r, tokens in zip(requests, answers, strict=True)}


async def _through_the_channel(
    url: str, adapters: dict[str, Path], requests: list[EngineRequest]
) -> tuple[dict[str, list[int]], Any]:
    client = RemoteEngineClient([url], TOKEN)
    await client.start()
    try:
        for digest, folder in adapters.items():
            await client.ensure_adapter(digest, folder)
        outputs = await _generate_all(client, requests)
        [stats] = await client.stats()
        return outputs, stats
    finally:
        await client.close()


def test_greedy_through_the_engine_process_equals_transformers_and_peft_under_preemption(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    folders = demo_adapter_dirs[:2]
    spec = BaseModelSpec.from_model_dir(demo_model_dir)
    digests = {f.name: load_peft_adapter(f, spec).digest for f in folders}
    adapter_of = [None, folders[0].name, folders[1].name]  # base and two adapters, interleaved
    requests = [
        EngineRequest(
            f"r{i}",
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            prompt_token_ids=prompt,
            adapter=digests[name] if (name := adapter_of[i % 3]) else None,
        )
        for i, prompt in enumerate(_prompts())
    ]

    with engine_process(demo_model_dir, tmp_path / "engine", TOKEN, SMALL_ENGINE) as engine:
        by_digest = {digests[f.name]: f for f in folders}
        outputs, stats = asyncio.run(_through_the_channel(engine.url, by_digest, requests))
        threads = engine.metrics()["loramux_engine_cpu_threads"]
    assert threads == 1, "the engine's process runs torch on the threads it was given"
    assert stats.preemptions > 0, "the KV pool was meant to be small enough to force preemption"
    assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0

    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    for i, r in enumerate(requests):
        if adapter_of[i % 3] is None:
            expected = hf_greedy(base, r.prompt_token_ids or [], MAX_TOKENS)
            assert outputs[r.request_id] == expected, f"base prompt {i}"
    peft = PeftModel.from_pretrained(base, folders[0], adapter_name=folders[0].name)
    peft.load_adapter(folders[1], adapter_name=folders[1].name)
    for i, r in enumerate(requests):
        if (name := adapter_of[i % 3]) is not None:
            expected = peft_greedy(peft.eval(), name, r.prompt_token_ids or [], MAX_TOKENS)
            assert outputs[r.request_id] == expected, f"prompt {i} on {name}"
