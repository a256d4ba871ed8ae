"""Loading genuine PEFT adapters: weights, scaling, targets and the content digest."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from loramux.adapters.peft_format import AdapterLimits, LoraAdapter, load_peft_adapter
from tests.adapters.peft_adapters import (
    edit_config,
    edit_weights,
    load_weights,
    lora_key,
    make_peft_adapter,
    save_weights,
    tiny_base,
    tiny_model,
)

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(folder: Path, **limits: int) -> LoraAdapter:
    return load_peft_adapter(folder, tiny_base(), AdapterLimits(**limits))


def peft_deltas(folder: Path) -> dict[tuple[int, str], torch.Tensor]:
    """PEFT's own delta weight (scaling * B @ A) for every adapted module."""
    model = PeftModel.from_pretrained(tiny_model(), folder)
    deltas = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            layer = int(name.split(".layers.")[1].split(".")[0])
            proj = name.rsplit(".", 1)[1].removesuffix("_proj")
            deltas[layer, proj] = module.get_delta_weight("default").float()
    return deltas


def test_folded_delta_equals_peft_delta_weight(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", r=8, lora_alpha=16, target_modules=ALL_SEVEN)
    adapter = load(folder)
    deltas = peft_deltas(folder)
    assert set(adapter.modules) == set(deltas)
    assert len(deltas) == 2 * 7
    for module, weights in adapter.modules.items():
        torch.testing.assert_close(weights.b @ weights.a, deltas[module], rtol=1e-5, atol=1e-6)


def test_a_is_stored_as_is_and_b_carries_the_scaling(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", r=4, lora_alpha=12, target_modules=["q_proj"])
    adapter = load(folder)
    raw = load_weights(folder)
    assert adapter.scaling == 3.0
    assert (adapter.rank, adapter.alpha, adapter.use_rslora) == (4, 12.0, False)
    q = adapter.modules[1, "q"]
    assert q.a.dtype == q.b.dtype == torch.float32
    assert torch.equal(q.a, raw[lora_key(1, "q", "A")])
    assert torch.equal(q.b, raw[lora_key(1, "q", "B")] * 3.0)
    assert q.a.shape == (4, 64) and q.b.shape == (64, 4)


def test_rslora_scales_by_alpha_over_sqrt_rank(tmp_path: Path) -> None:
    folder = make_peft_adapter(
        tmp_path / "a", r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "down_proj"]
    )
    adapter = load(folder)
    assert adapter.use_rslora
    assert adapter.scaling == pytest.approx(8 / math.sqrt(16))
    deltas = peft_deltas(folder)
    for module, weights in adapter.modules.items():
        torch.testing.assert_close(weights.b @ weights.a, deltas[module], rtol=1e-5, atol=1e-6)


def test_shapes_follow_grouped_query_attention(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", r=8, target_modules=ALL_SEVEN)
    modules = load(folder).modules
    expected = {"q": (64, 64), "k": (64, 32), "v": (64, 32), "o": (64, 64)}
    expected |= {"gate": (64, 96), "up": (64, 96), "down": (96, 64)}
    for (_, proj), weights in modules.items():
        assert (weights.a.shape[1], weights.b.shape[0]) == expected[proj]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_convert_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    folder = make_peft_adapter(tmp_path / "a", r=8, lora_alpha=8, dtype=dtype)
    raw = load_weights(folder)
    assert raw[lora_key(0, "q", "A")].dtype == dtype
    q = load(folder).modules[0, "q"]
    assert torch.equal(q.a, raw[lora_key(0, "q", "A")].float())
    assert torch.equal(q.b, raw[lora_key(0, "q", "B")].float())


def test_targets_lists_adapted_projections_in_canonical_order(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", target_modules=["down_proj", "v_proj", "q_proj"])
    assert load(folder).targets == ("q", "v", "down")


def test_all_linear_targets_every_projection(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", target_modules="all-linear")
    adapter = load(folder)
    assert adapter.targets == ("q", "k", "v", "o", "gate", "up", "down")
    assert len(adapter.modules) == 14


def test_layers_to_transform_adapts_only_those_layers(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", target_modules=["q_proj"], layers_to_transform=[1])
    assert set(load(folder).modules) == {(1, "q")}
    assert set(load(folder).modules) == set(peft_deltas(folder))


def test_exclude_modules_are_left_out(tmp_path: Path) -> None:
    folder = make_peft_adapter(
        tmp_path / "a",
        target_modules=["o_proj"],
        exclude_modules=["model.layers.0.self_attn.o_proj"],
    )
    assert set(load(folder).modules) == {(1, "o")}


def test_digest_is_stable_across_saves_and_key_order(tmp_path: Path) -> None:
    first = make_peft_adapter(tmp_path / "first", seed=3)
    second = make_peft_adapter(tmp_path / "second", seed=3)
    digest = load(first).digest
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert load(second).digest == digest
    edit_config(second, base_model_name_or_path="elsewhere", lora_dropout=0.3, inference_mode=False)
    edit_weights(second, lambda tensors: dict(reversed(list(tensors.items()))))
    assert load(second).digest == digest


def test_digest_changes_with_any_weight(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    before = load(folder).digest

    def nudge(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors[lora_key(1, "v", "B")][3, 2] += 1e-3
        return tensors

    edit_weights(folder, nudge)
    assert load(folder).digest != before


@pytest.mark.parametrize("change", [{"lora_alpha": 17}, {"use_rslora": True}])
def test_digest_changes_with_scaling(tmp_path: Path, change: dict[str, object]) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    before = load(folder).digest
    edit_config(folder, **change)
    assert load(folder).digest != before


def test_digest_changes_with_dtype(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", r=8, lora_alpha=8)
    before = load(folder).digest
    edit_weights(folder, lambda tensors: {k: v.to(torch.float16) for k, v in tensors.items()})
    assert load(folder).digest != before


def test_bare_llama_model_key_prefix_is_accepted(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    before = load(folder)
    renamed = {
        key.replace("base_model.model.model.", "base_model.model."): value
        for key, value in load_weights(folder).items()
    }
    save_weights(folder, renamed)
    after = load(folder)
    assert after.digest == before.digest
    assert torch.equal(after.modules[0, "q"].b, before.modules[0, "q"].b)


def test_limits_are_validated() -> None:
    assert AdapterLimits().max_rank == 64
    assert AdapterLimits(max_rank=256).max_rank == 256
    with pytest.raises(ValueError, match="max_rank"):
        AdapterLimits(max_rank=512)
    with pytest.raises(ValueError, match="max_file_bytes"):
        AdapterLimits(max_file_bytes=0)
