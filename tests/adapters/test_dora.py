"""DoRA adapters: their magnitude vectors are read and checked, and the per-channel scale
computed at load equals what PEFT's DoRA layer multiplies the output by."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel

from loramux.adapters.errors import AdapterError
from loramux.adapters.peft_format import AdapterLimits, load_peft_adapter
from loramux.adapters.peft_top import BaseWeights
from loramux.engine.lora.manager import LoraManager
from tests.adapters.peft_adapters import (
    HfBaseWeights,
    edit_config,
    edit_weights,
    load_weights,
    make_peft_adapter,
    tiny_base,
    tiny_model,
)

TARGETS = ["q_proj", "v_proj", "down_proj"]


def magnitude_key(layer: int, proj: str) -> str:
    parent = "mlp" if proj in ("gate", "up", "down") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{parent}.{proj}_proj.lora_magnitude_vector"


def base_weights(model: torch.nn.Module) -> BaseWeights:
    return HfBaseWeights(model)


def make_dora(folder: Path, seed: int = 0, **kwargs: object) -> Path:
    """A DoRA adapter of the tiny model whose magnitudes move each channel by up to 30%."""
    make_peft_adapter(folder, seed=seed, use_dora=True, target_modules=TARGETS, **kwargs)
    generator = torch.Generator().manual_seed(seed + 1)

    def spread(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for key in tensors:
            if key.endswith("lora_magnitude_vector"):
                tensors[key] = 1.0 + 0.3 * torch.rand(tensors[key].shape, generator=generator)
        return tensors

    edit_weights(folder, spread)
    return folder


def refusal(folder: Path) -> AdapterError:
    with pytest.raises(AdapterError) as raised:
        load_peft_adapter(folder, tiny_base(), base_weights=base_weights(tiny_model()))
    return raised.value


def test_the_scale_is_what_peft_multiplies_each_output_channel_by(tmp_path: Path) -> None:
    folder = make_dora(tmp_path / "d", r=8)
    model = tiny_model()
    adapter = load_peft_adapter(folder, tiny_base(), base_weights=base_weights(model))
    assert adapter.use_dora and len(adapter.modules) == 6
    peft_model = PeftModel.from_pretrained(tiny_model(), str(folder)).eval()
    x = torch.randn(7, 96)
    for (layer, proj), weights in adapter.modules.items():
        assert weights.scale is not None and weights.scale.dtype == torch.float32
        parent = peft_model.base_model.model.model.layers[layer]
        module = getattr(parent.mlp if proj == "down" else parent.self_attn, f"{proj}_proj")
        inputs = x[:, : weights.a.shape[1]]
        with torch.no_grad():
            expected = module(inputs)
        base = inputs @ base_weights(model).projection_weight(layer, proj).T
        served = (base + inputs @ weights.a.T @ weights.b.T) * weights.scale
        torch.testing.assert_close(served, expected, rtol=1e-5, atol=1e-5)
        plain = base + inputs @ weights.a.T @ weights.b.T
        assert not torch.allclose(plain, expected, atol=1e-3), "the scale must matter here"


def test_without_base_weights_a_dora_adapter_is_validated_but_has_no_scale(
    tmp_path: Path,
) -> None:
    adapter = load_peft_adapter(make_dora(tmp_path / "d"), tiny_base())
    assert adapter.use_dora
    assert all(w.scale is None for w in adapter.modules.values())


def test_dora_and_plain_lora_with_the_same_pairs_have_different_digests(tmp_path: Path) -> None:
    dora = make_dora(tmp_path / "d")
    plain = make_peft_adapter(tmp_path / "p", target_modules=TARGETS)
    pairs = {k: v for k, v in load_weights(dora).items() if "magnitude" not in k}
    edit_weights(plain, lambda _: pairs)
    assert (
        load_peft_adapter(dora, tiny_base()).digest != load_peft_adapter(plain, tiny_base()).digest
    )


def test_an_engine_without_base_weights_refuses_dora(tmp_path: Path) -> None:
    manager = LoraManager(tiny_base(), 2, 2, AdapterLimits(), torch.float32, "cpu")
    try:
        with pytest.raises(AdapterError) as raised:
            manager.register(make_dora(tmp_path / "d"))
        assert raised.value.code == "dora_unsupported"
    finally:
        manager.shutdown()


def test_a_missing_magnitude_is_refused(tmp_path: Path) -> None:
    folder = make_dora(tmp_path / "d")
    gone = magnitude_key(1, "v")
    edit_weights(folder, lambda tensors: {k: v for k, v in tensors.items() if k != gone})
    error = refusal(folder)
    assert error.code == "missing_tensors" and "layers.1.v.lora_magnitude" in error.message


def test_a_magnitude_without_use_dora_is_unexplained(tmp_path: Path) -> None:
    folder = make_dora(tmp_path / "d")
    edit_config(folder, use_dora=False)
    assert refusal(folder).code == "unexpected_tensors"


@pytest.mark.parametrize("value", ["yes", 1, [True], {"on": True}])
def test_use_dora_must_be_a_boolean(tmp_path: Path, value: object) -> None:
    folder = make_dora(tmp_path / "d")
    edit_config(folder, use_dora=value)
    assert refusal(folder).code == "invalid_config"


@pytest.mark.parametrize("shape", [(63,), (64, 1), (1, 64), (65,), ()])
def test_a_magnitude_of_another_shape_is_refused(tmp_path: Path, shape: tuple[int, ...]) -> None:
    folder = make_dora(tmp_path / "d")
    key = magnitude_key(0, "q")
    edit_weights(folder, lambda tensors: tensors | {key: torch.ones(shape)})
    assert refusal(folder).code == "shape_mismatch"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_magnitude_is_refused(tmp_path: Path, value: float) -> None:
    folder = make_dora(tmp_path / "d")
    key = magnitude_key(0, "down")

    def poison(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors[key][3] = value
        return tensors

    edit_weights(folder, poison)
    assert refusal(folder).code == "non_finite_weights"
    with pytest.raises(AdapterError):  # also without the base weights (gateway validation)
        load_peft_adapter(folder, tiny_base())


def test_a_row_whose_merged_norm_is_zero_is_refused(tmp_path: Path) -> None:
    """W + s B A with a zero row: PEFT would divide by zero; the scale is not finite."""
    folder = make_dora(tmp_path / "d")
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[5] = 0.0

    def zero_row(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = magnitude_key(0, "q").replace("lora_magnitude_vector", "lora_B.weight")
        tensors[key][5] = 0.0
        return tensors

    edit_weights(folder, zero_row)
    with pytest.raises(AdapterError) as raised:
        load_peft_adapter(folder, tiny_base(), base_weights=base_weights(model))
    assert raised.value.code == "non_finite_weights"
    assert "norm zero" in raised.value.message
