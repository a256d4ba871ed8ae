"""Adapters with LoRA on the token embedding or the lm_head, or their own copy of either
(`modules_to_save`), in one batch with plain LoRA adapters and base-model requests, give
PEFT's greedy tokens, from their device slots and on the host path; their memory is counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.errors import AdapterError
from loramux.adapters.layout import LoraStack
from loramux.adapters.peft_format import load_peft_adapter
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from tests.adapters.peft_adapters import edit_weights, make_peft_adapter
from tests.engine.adapter_batches import (
    assert_equal_to_reference,
    mixed_requests,
    random_prompt,
    reference_greedy,
    run_tokens,
)
from tests.engine.conftest import make_engine

KINDS: dict[str, dict[str, Any]] = {
    "embed-lora": {"r": 8, "target_modules": ["embed_tokens", "q_proj", "v_proj"]},
    "head-lora": {"r": 16, "target_modules": ["lm_head"]},
    "head-saved": {"r": 8, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
    "embed-saved": {"r": 4, "target_modules": ["o_proj"], "modules_to_save": ["embed_tokens"]},
    # PEFT keeps LoRA off the saved lm_head, and "head" saves it (a plain suffix)
    "head-targeted-and-saved": {
        "r": 8,
        "target_modules": ["k_proj", "lm_head"],
        "modules_to_save": ["lm_head"],
    },
    "head-saved-by-suffix": {"r": 4, "target_modules": ["up_proj"], "modules_to_save": ["head"]},
}
PLAIN_INDICES = (1, 2)


def _demo_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def top_dirs(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The kinds on the demo model; saved copies are the base weights plus seeded noise."""
    out = tmp_path_factory.mktemp("top")
    folders = {}
    for seed, (name, kwargs) in enumerate(KINDS.items()):
        folder = make_peft_adapter(
            out / name, seed=seed, model=_demo_model(demo_model_dir), **kwargs
        )
        edit_weights(folder, lambda tensors, seed=seed: _perturb_saved(tensors, seed))
        folders[name] = folder
    return folders


def _perturb_saved(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + seed)
    for key in ("base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"):
        if key in tensors:
            noise = torch.randn(tensors[key].shape, generator=generator)
            tensors[key] = tensors[key] + noise * tensors[key].std()
    return tensors


@pytest.fixture(scope="module")
def reference(
    demo_model_dir: Path, top_dirs: dict[str, Path], demo_adapter_dirs: list[Path]
) -> dict[str, Any]:
    """A PeftModel per adapter name (PEFT cannot hold LoRA on the lm_head and a saved lm_head
    in one model), and "base"."""
    from peft import PeftModel

    folders = _all(top_dirs, demo_adapter_dirs)
    models = {
        name: PeftModel.from_pretrained(_demo_model(demo_model_dir), folder, adapter_name=name)
        for name, folder in folders.items()
    }
    return models | {"base": models[next(iter(folders))]}


def _all(top_dirs: dict[str, Path], demo_adapter_dirs: list[Path]) -> dict[str, Path]:
    return top_dirs | {demo_adapter_dirs[i].name: demo_adapter_dirs[i] for i in PLAIN_INDICES}


def _idle_and_clean(engine: LLMEngine) -> None:
    lora = engine.lora
    assert lora is not None
    assert all(slot.pins == 0 for slot in lora.slots)
    assert lora.host_buffers.counts().in_use == lora.host_tier_size()


def test_each_kind_changes_what_peft_generates(
    top_dirs: dict[str, Path], reference: dict[str, Any]
) -> None:
    prompt = random_prompt(5)
    base = reference_greedy(reference["base"], None, prompt)
    for name in top_dirs:
        assert reference_greedy(reference[name], name, prompt) != base, name


def test_top_modules_mixed_with_lora_and_base_in_one_batch_equal_peft(
    demo_model_dir: Path,
    top_dirs: dict[str, Path],
    demo_adapter_dirs: list[Path],
    reference: dict[str, Any],
) -> None:
    engine = make_engine(demo_model_dir, max_loras=8, lora_copy_groups_per_step=1000)
    requests = mixed_requests(engine, _all(top_dirs, demo_adapter_dirs), seed=30)
    tokens = run_tokens(engine, requests)
    assert_equal_to_reference(tokens, requests, reference.__getitem__)
    _idle_and_clean(engine)


def test_top_modules_on_the_host_path_equal_peft(
    demo_model_dir: Path,
    top_dirs: dict[str, Path],
    demo_adapter_dirs: list[Path],
    reference: dict[str, Any],
) -> None:
    # Two blocks per step: every adapter starts on its host copy and moves to its slot.
    engine = make_engine(demo_model_dir, max_loras=8, lora_copy_groups_per_step=2)
    requests = mixed_requests(engine, _all(top_dirs, demo_adapter_dirs), seed=30)
    tokens = run_tokens(engine, requests)
    stats = engine.adapter_stats()
    for r in requests:
        if r.adapter:
            s = stats[r.adapter]
            ready = s.device_ready_step  # None: still copying when the requests ended
            assert s.first_token_step is not None and s.host_path_tokens > 0, r.request_id
            assert ready is None or s.first_token_step < ready, r.request_id
    assert_equal_to_reference(tokens, requests, reference.__getitem__)
    _idle_and_clean(engine)


def test_a_saved_lm_head_is_counted_against_the_adapter_memory(
    demo_model_dir: Path, top_dirs: dict[str, Path]
) -> None:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    adapter = load_peft_adapter(top_dirs["head-saved"], base)
    lm_head = base.vocab * base.hidden_size
    assert LoraStack.region_elements(adapter) > lm_head
    small = make_engine(demo_model_dir, lora_memory_bytes=lm_head * 4)  # float32: just too small
    with pytest.raises(AdapterError) as raised:
        small.register_adapter(top_dirs["head-saved"])
    assert raised.value.code == "over_memory_budget"
    engine = make_engine(demo_model_dir, max_loras=4)
    digest = engine.register_adapter(top_dirs["head-saved"])
    run_tokens(
        engine,
        [EngineRequest("r", SamplingParams(max_tokens=2), prompt_token_ids=[5, 6], adapter=digest)],
    )
    element = 4
    assert (
        engine.adapter_stats()[digest].device_bytes == LoraStack.region_elements(adapter) * element
    )
