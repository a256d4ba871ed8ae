"""Adapter memory sized by rank, through the real engine: sixty adapters of ranks 4 to 64 in
a budget that holds twenty rank-64 ones are resident together, and each one's output equals
PEFT's token for token."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.layout import LoraStack
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from tests.adapters.peft_adapters import make_peft_adapter
from tests.engine.conftest import make_engine, run_to_completion

MAX_TOKENS = 6
RANK_4_TARGETS = (["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"], ["o_proj"])


@pytest.fixture(scope="module")
def sixty_adapters(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> list[Path]:
    """The 40 demo adapters (ranks 8-64) and 20 genuine PEFT adapters of rank 4."""
    out = tmp_path_factory.mktemp("rank-4")
    extra = []
    for i in range(20):
        model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
        extra.append(
            make_peft_adapter(
                out / f"rank4-{i:02d}",
                seed=i,
                model=model,
                r=4,
                lora_alpha=8,
                target_modules=RANK_4_TARGETS[i % len(RANK_4_TARGETS)],
            )
        )
    return [*demo_adapter_dirs, *extra]


@pytest.fixture(scope="module")
def peft_model(demo_model_dir: Path, sixty_adapters: list[Path]) -> Any:
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, sixty_adapters[0], adapter_name=sixty_adapters[0].name)
    for folder in sixty_adapters[1:]:
        model.load_adapter(folder, adapter_name=folder.name)
    return model.eval()


def peft_greedy(model: Any, adapter: str, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            adapter_names=[adapter],
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def _prompt(i: int) -> list[int]:
    rng = random.Random(1000 + i)
    return [rng.randrange(3, 4096) for _ in range(rng.randrange(4, 40))]


def test_sixty_adapters_of_ranks_4_to_64_share_the_memory_of_twenty_rank_64_ones(
    demo_model_dir: Path, sixty_adapters: list[Path], peft_model: Any
) -> None:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    budget = 20 * LoraStack.full_rank_elements(base, 64) * 4  # float32
    engine = make_engine(
        demo_model_dir,
        max_loras=64,
        max_cpu_loras=64,
        lora_memory_bytes=budget,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        num_kv_blocks=512,
    )
    assert engine.lora is not None
    digests = [engine.register_adapter(f) for f in sixty_adapters]
    ranks = {json.loads((f / "adapter_config.json").read_text())["r"] for f in sixty_adapters}
    assert ranks == {4, 8, 16, 32, 64}
    outputs: dict[str, list[int]] = {}
    for i, digest in enumerate(digests):
        request = EngineRequest(
            f"r{i}",
            SamplingParams(max_tokens=MAX_TOKENS),
            prompt_token_ids=_prompt(i),
            adapter=digest,
        )
        engine.add_request(request)
        outputs[f"r{i}"] = []
    most_pinned = 0
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
        most_pinned = max(most_pinned, sum(slot.pins > 0 for slot in engine.lora.slots))
        used, total = engine.lora.memory()
        assert used <= total == budget
        assert used == sum(s.device_bytes for s in engine.lora.stats.values())
    assert most_pinned > 20, f"only {most_pinned} adapters were resident at once"
    for i, folder in enumerate(sixty_adapters):
        assert outputs[f"r{i}"] == peft_greedy(peft_model, folder.name, _prompt(i)), folder.name


def test_a_large_adapter_lets_small_ones_go_first_for_a_bounded_time(
    demo_model_dir: Path, sixty_adapters: list[Path]
) -> None:
    """The pool holds one rank-64 adapter on every projection, or many rank-4 ones. With small
    ones resident, a request for the large one (which would evict them all) defers to the small
    requests behind it, then runs once they are done."""
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    engine = make_engine(
        demo_model_dir,
        max_loras=16,
        lora_memory_bytes=LoraStack.full_rank_elements(base, 64) * 4,
        max_num_seqs=16,
    )
    large = engine.register_adapter(sixty_adapters[15])  # rank 64, all seven projections
    small = [engine.register_adapter(f) for f in sixty_adapters[40:46]]  # rank 4
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    warm = [
        EngineRequest(f"warm{i}", params, prompt_token_ids=_prompt(i), adapter=d)
        for i, d in enumerate(small)
    ]
    run_to_completion(engine, warm)
    engine.add_request(EngineRequest("large", params, prompt_token_ids=_prompt(50), adapter=large))
    for i, digest in enumerate(small):
        engine.add_request(
            EngineRequest(f"small{i}", params, prompt_token_ids=_prompt(60 + i), adapter=digest)
        )
    started: dict[str, int] = {}
    step = 0
    while engine.has_work:
        for out in engine.step():
            started.setdefault(out.request_id, step)
        step += 1
        assert step < 200, "a request starved"
    assert len(started) == 7
    assert all(started[f"small{i}"] < started["large"] for i in range(6))
