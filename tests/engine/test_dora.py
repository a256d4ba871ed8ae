"""DoRA served exactly: DoRA adapters of ranks 8 and 32, on attention only and on attention plus
MLP, in one batch with plain LoRA adapters and base-model requests, give PEFT's `use_dora`
greedy tokens; so do their requests that start on the host path while the device copy runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel

from loramux.adapters.demo import build_demo_adapters, demo_lora_config
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from tests.adapters.peft_adapters import edit_config, edit_weights
from tests.engine.adapter_batches import (
    MAX_TOKENS,
    assert_equal_to_reference,
    mixed_requests,
    random_prompt,
    reference_greedy,
    run_tokens,
)
from tests.engine.conftest import make_engine

DORA_INDICES = (0, 6, 10, 16)
"""Demo adapters (rank, targets): 0 (8, all seven), 6 (32, attention), 10 (32, all seven),
16 (8, attention)."""
PLAIN_INDICES = (1, 2)


@pytest.fixture(scope="module")
def dora_dirs(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folders = build_demo_adapters(
        demo_model_dir, tmp_path_factory.mktemp("dora"), max(DORA_INDICES) + 1, dora=True
    )
    return [folders[i] for i in DORA_INDICES]


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path, dora_dirs: list[Path], demo_adapter_dirs: list[Path]) -> Any:
    """PEFT holding the DoRA adapters (as `dora-<folder>`) and the plain ones (by folder name)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, dora_dirs[0], adapter_name=f"dora-{dora_dirs[0].name}")
    for folder in dora_dirs[1:]:
        model.load_adapter(folder, adapter_name=f"dora-{folder.name}")
    for index in PLAIN_INDICES:
        model.load_adapter(demo_adapter_dirs[index], adapter_name=demo_adapter_dirs[index].name)
    return model.eval()


def _adapters(dora_dirs: list[Path], demo_adapter_dirs: list[Path]) -> dict[str, Path]:
    names = {f"dora-{f.name}": f for f in dora_dirs}
    return names | {demo_adapter_dirs[i].name: demo_adapter_dirs[i] for i in PLAIN_INDICES}


def test_the_demo_dora_adapters_are_what_the_test_needs(dora_dirs: list[Path]) -> None:
    configs = [demo_lora_config(i) for i in DORA_INDICES]
    assert sorted({c.r for c in configs}) == [8, 32]
    assert {len(c.target_modules) for c in configs} == {4, 7}  # attention; attention and MLP


def test_dora_mixed_with_lora_and_base_in_one_batch_equals_peft(
    demo_model_dir: Path, dora_dirs: list[Path], demo_adapter_dirs: list[Path], reference: Any
) -> None:
    engine = make_engine(demo_model_dir, max_loras=8)
    requests = mixed_requests(engine, _adapters(dora_dirs, demo_adapter_dirs), seed=0)
    warm = [  # every adapter into its slot first: the batch then runs the kernels' path
        EngineRequest(
            f"warm-{i}", SamplingParams(max_tokens=1), prompt_token_ids=[5, 6], adapter=r.adapter
        )
        for i, r in enumerate(requests)
        if r.adapter
    ]
    run_tokens(engine, warm)
    while len(engine.lora.copies):  # type: ignore[union-attr]
        engine.step()
    on_host = {d: s.host_path_tokens for d, s in engine.adapter_stats().items()}
    steps = engine.stats().steps
    tokens = run_tokens(engine, requests)
    assert engine.stats().steps - steps <= MAX_TOKENS + 2, "requests were meant to share steps"
    assert {d: s.host_path_tokens for d, s in engine.adapter_stats().items()} == on_host
    assert_equal_to_reference(tokens, requests, lambda _: reference)


def test_dora_requests_on_the_host_path_equal_peft(
    demo_model_dir: Path, dora_dirs: list[Path], demo_adapter_dirs: list[Path], reference: Any
) -> None:
    # Two (layer, group) blocks copied per step: every adapter starts on the host path.
    engine = make_engine(demo_model_dir, max_loras=8, lora_copy_groups_per_step=2)
    requests = mixed_requests(engine, _adapters(dora_dirs, demo_adapter_dirs), seed=0)
    tokens = run_tokens(engine, requests)
    stats = engine.adapter_stats()
    assert all(stats[r.adapter].host_path_tokens > 0 for r in requests if r.adapter)
    assert_equal_to_reference(tokens, requests, lambda _: reference)


def test_the_scale_changes_what_the_adapters_generate(
    dora_dirs: list[Path], reference: Any, tmp_path: Path
) -> None:
    """Without its magnitudes a DoRA adapter is plain LoRA with the same pairs: PEFT's tokens
    for the two differ, so the tests above cannot pass with the scale ignored."""
    for folder in dora_dirs:
        plain = tmp_path / folder.name
        shutil.copytree(folder, plain)
        edit_config(plain, use_dora=False)
        edit_weights(plain, lambda ts: {k: v for k, v in ts.items() if "magnitude" not in k})
        reference.load_adapter(plain, adapter_name=f"plain-{folder.name}")
        prompt = random_prompt(7)
        dora = reference_greedy(reference, f"dora-{folder.name}", prompt)
        assert dora != reference_greedy(reference, f"plain-{folder.name}", prompt), folder.name
