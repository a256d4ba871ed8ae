"""What serving every request on an adapter adds to the engine's decode step (part 2 of
bench.lora_kernels): the step at several batch sizes with every request on an adapter (ranks
8/16/32/64 round-robin, all seven projections) against every request on the base model."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from bench.common import RunSettings, median, now
from loramux.adapters.base_spec import PROJECTIONS, BaseModelSpec
from loramux.adapters.peft_config import PARENT_MODULE
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams


class OverheadSizes(Protocol):
    """The sizes of a run (bench.lora_kernels.Workload has them)."""

    @property
    def prompt_len(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def num_adapters(self) -> int: ...
    @property
    def batch_sizes(self) -> tuple[int, ...]: ...


def write_adapter(
    folder: Path, base: BaseModelSpec, rank: int, seed: int, device: str = "cpu"
) -> Path:
    """A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, PEFT's key
    names) adapting all seven projections of every layer at `rank`, with seeded weights small
    enough to keep activations O(1), drawn on `device` (fast on a GPU for large models)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none"}
    config["target_modules"] = [f"{proj}_proj" for proj in PROJECTIONS]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    gen = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for proj in PROJECTIONS:
            shape = base.projection_shape(proj)
            key = f"base_model.model.model.layers.{layer}.{PARENT_MODULE[proj]}.{proj}_proj"
            a = torch.randn(rank, shape.in_features, generator=gen, device=device)
            b = torch.randn(shape.out_features, rank, generator=gen, device=device)
            a = a / shape.in_features**0.5
            b = b * (0.1 / rank**0.5)
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    return folder


def decode_step_ms(
    engine: LLMEngine,
    adapters: Sequence[str | None],
    w: OverheadSizes,
    rng: random.Random,
    tag: str,
) -> float:
    """Median decode step of len(adapters) running requests, request i on adapters[i] (None:
    the base model), once all have their first token and 3 steps more; then abort them.
    No request finishes before: prefill takes at most prompt_len steps (budget >= batch)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=w.prompt_len + w.steps + 4, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(adapters))]
    for request_id, adapter in zip(ids, adapters, strict=True):
        prompt = [rng.randrange(3, vocab) for _ in range(w.prompt_len)]
        engine.add_request(
            EngineRequest(request_id, params, prompt_token_ids=prompt, adapter=adapter)
        )
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step())
    for _ in range(3):
        engine.step()
    device = engine.config.device
    times = []
    for _ in range(w.steps):
        begin = now(device)
        engine.step()
        times.append(now(device) - begin)
    for request_id in ids:
        engine.abort(request_id)
    return median(times) * 1e3


def measure_overhead(
    settings: RunSettings, model_dir: Path, workdir: Path, w: OverheadSizes
) -> dict[int, dict[str, float]]:
    """Per batch size: base and LoRA decode step milliseconds."""
    base = BaseModelSpec.from_model_dir(model_dir)
    ranks = [(8, 16, 32, 64)[i % 4] for i in range(w.num_adapters)]
    config = overhead_config(settings, model_dir, w)
    engine = LLMEngine(config)
    digests = [
        engine.register_adapter(write_adapter(workdir / f"adapter-{i}", base, r, seed=i))
        for i, r in enumerate(ranks)
    ]
    rng = random.Random(0)
    decode_step_ms(engine, [None, digests[0]], w, rng, "warm-up")
    steps: dict[int, dict[str, float]] = {}
    for batch in w.batch_sizes:
        lora = [digests[i % len(digests)] for i in range(batch)]
        steps[batch] = {
            "base_ms": decode_step_ms(engine, [None] * batch, w, rng, f"base-{batch}"),
            "lora_ms": decode_step_ms(engine, lora, w, rng, f"lora-{batch}"),
        }
    return steps


def overhead_config(settings: RunSettings, model_dir: Path, w: OverheadSizes) -> EngineConfig:
    return settings.engine(
        max_model_len=2 * w.prompt_len + w.steps + 4,
        max_num_seqs=max(w.batch_sizes),
        max_num_batched_tokens=4096 if settings.is_cuda else 512,
        kv_cache_mb=8 << 10 if settings.is_cuda else 64,
        max_loras=w.num_adapters,
        max_cpu_loras=w.num_adapters,
        max_lora_rank=64,
    ).engine_config(model_dir)
