"""Demo adapters: genuine, varied, reproducible PEFT adapters that visibly change the demo model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.demo import (
    DEMO_RANKS,
    DEMO_TARGET_SETS,
    build_demo_adapters,
    demo_lora_config,
)
from loramux.adapters.peft_format import LoraAdapter, load_peft_adapter

COUNT = 40  # what the session fixture `demo_adapter_dirs` builds


@pytest.fixture(scope="module")
def demo_adapters(demo_adapter_dirs: list[Path]) -> list[Path]:
    return demo_adapter_dirs


@pytest.fixture(scope="module")
def loaded(demo_model_dir: Path, demo_adapters: list[Path]) -> list[LoraAdapter]:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    return [load_peft_adapter(folder, base) for folder in demo_adapters]


def test_folders_are_what_peft_save_pretrained_writes(demo_adapters: list[Path]) -> None:
    assert [folder.name for folder in demo_adapters] == [f"adapter-{i:03d}" for i in range(COUNT)]
    for folder in demo_adapters:
        names = {path.name for path in folder.iterdir()}
        assert names == {"adapter_config.json", "adapter_model.safetensors", "README.md"}


def test_every_rank_and_target_set_is_covered(loaded: list[LoraAdapter]) -> None:
    """4 ranks x 5 target sets, cycled: any 20 consecutive adapters hold every combination."""
    combinations = {(adapter.rank, adapter.targets) for adapter in loaded[:20]}
    assert combinations == {(rank, targets) for rank in DEMO_RANKS for targets in DEMO_TARGET_SETS}
    assert {adapter.use_rslora for adapter in loaded} == {True, False}
    assert len({adapter.digest for adapter in loaded}) == COUNT


def test_adapters_are_a_function_of_seed_and_index(
    demo_model_dir: Path, loaded: list[LoraAdapter], tmp_path: Path
) -> None:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    again = build_demo_adapters(demo_model_dir, tmp_path / "again", count=2)
    other_seed = build_demo_adapters(demo_model_dir, tmp_path / "other", count=2, seed=1)
    assert [load_peft_adapter(f, base).digest for f in again] == [a.digest for a in loaded[:2]]
    assert load_peft_adapter(other_seed[0], base).digest != loaded[0].digest


def test_each_adapter_changes_greedy_output_and_stays_sane(
    demo_model_dir: Path, demo_adapters: list[Path]
) -> None:
    """The first five cover every target set; teacher-forced greedy picks must mostly change."""
    base = LlamaForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    prompt = torch.randint(3, 4096, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(prompt).logits[0]
        base_continuation = base.generate(prompt, max_new_tokens=6, do_sample=False)
        model = PeftModel.from_pretrained(base, demo_adapters[0], adapter_name="0")
        for index, folder in enumerate(demo_adapters[1:5], start=1):
            model.load_adapter(folder, adapter_name=str(index))
        for index in range(5):
            model.set_adapter(str(index))
            logits = model(prompt).logits[0]
            changed = (logits.argmax(-1) != base_logits.argmax(-1)).float().mean().item()
            continuation = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
            assert changed > 0.5, f"adapter {index} changes only {changed:.0%} of greedy picks"
            assert not torch.equal(continuation, base_continuation)
            assert logits.isfinite().all() and logits.abs().max() < 10 * base_logits.abs().max()


def test_a_rank_cycle_changes_only_the_ranks() -> None:
    """A wider model's benchmark picks smaller ranks; targets, alpha and rsLoRA cycle as before."""
    for index in range(20):
        default, chosen = demo_lora_config(index), demo_lora_config(index, (4, 8, 16))
        assert chosen.r == (4, 8, 16)[index % 3]
        assert default.r == DEMO_RANKS[index % len(DEMO_RANKS)]
        assert chosen.target_modules == default.target_modules
        assert (chosen.lora_alpha, chosen.use_rslora) == (default.lora_alpha, default.use_rslora)


@pytest.mark.parametrize("ranks", [(), (8, 0), (-4,)])
def test_a_rank_cycle_must_be_positive_ranks(ranks: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="ranks must be positive"):
        demo_lora_config(0, ranks)
