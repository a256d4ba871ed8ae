"""LoRA on the token embedding and the lm_head, and modules_to_save for them: read from genuine
PEFT folders, checked, and refused when they add tokens or were made for another model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from loramux.adapters.errors import AdapterError
from loramux.adapters.peft_format import LoraAdapter, load_peft_adapter
from tests.adapters.peft_adapters import (
    HfBaseWeights,
    edit_config,
    edit_weights,
    make_peft_adapter,
    tiny_base,
    tiny_model,
)

EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
EMBED_BASE = "base_model.model.model.embed_tokens.base_layer.weight"
SAVED_HEAD = "base_model.model.lm_head.weight"


def load(folder: Path, model: LlamaForCausalLM | None = None) -> LoraAdapter:
    return load_peft_adapter(folder, tiny_base(), base_weights=HfBaseWeights(model or tiny_model()))


def refusal(folder: Path, model: LlamaForCausalLM | None = None) -> AdapterError:
    with pytest.raises(AdapterError) as raised:
        load(folder, model)
    assert raised.value.message
    return raised.value


def test_embedding_lora_is_read_with_its_scaling_folded_in(tmp_path: Path) -> None:
    folder = make_peft_adapter(
        tmp_path / "a", r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]
    )
    adapter = load(folder)
    pair = adapter.top["embed_tokens"]
    assert pair.a.shape == (4, 128) and pair.b.shape == (64, 4) and pair.a.dtype == torch.float32
    assert set(adapter.top) == {"embed_tokens"} and not adapter.saved
    assert {proj for _, proj in adapter.modules} == {"q"}
    peft = torch.nn.functional.embedding(torch.tensor([3, 77]), pair.a.T) @ pair.b.T
    assert peft.shape == (2, 64) and adapter.scaling == 2.0


def test_lm_head_lora_and_saved_modules_are_read(tmp_path: Path) -> None:
    head = load(make_peft_adapter(tmp_path / "h", r=8, target_modules=["lm_head"]))
    assert head.top["lm_head"].a.shape == (8, 64) and head.top["lm_head"].b.shape == (128, 8)
    assert not head.modules
    saved = load(
        make_peft_adapter(
            tmp_path / "s", target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"]
        )
    )
    assert set(saved.saved) == {"lm_head", "embed_tokens"} and not saved.top
    assert saved.saved["lm_head"].shape == (128, 64)
    assert torch.equal(saved.saved["lm_head"], tiny_model().lm_head.weight.detach())


def test_all_linear_leaves_out_the_lm_head_as_peft_does(tmp_path: Path) -> None:
    adapter = load(make_peft_adapter(tmp_path / "a", target_modules="all-linear"))
    assert not adapter.top and len(adapter.modules) == 14


def test_digests_tell_the_modules_apart(tmp_path: Path) -> None:
    plain = load(make_peft_adapter(tmp_path / "p", target_modules=["q_proj"]))
    saved = load(
        make_peft_adapter(tmp_path / "s", target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    assert plain.digest != saved.digest


def test_a_saved_base_weight_of_another_model_is_refused(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", target_modules=["embed_tokens"])
    assert load(folder).top  # equal to this base model's copy: accepted, and dropped
    error = refusal(folder, tiny_model(seed=1))
    assert error.code == "base_weights_differ" and "embed_tokens" in error.message
    assert load_peft_adapter(folder, tiny_base()).top  # without base weights: not compared


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_modules": ["embed_tokens"]},
        {"target_modules": ["lm_head"]},
        {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]},
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    ],
)
def test_an_adapter_that_adds_tokens_is_refused(tmp_path: Path, kwargs: dict) -> None:
    model = tiny_model()
    model.resize_token_embeddings(132)
    folder = make_peft_adapter(tmp_path / "a", model=model, **kwargs)
    error = refusal(folder)
    assert error.code == "added_tokens_unsupported"
    assert "132" in error.message


def test_a_saved_module_in_target_modules_is_only_saved_as_peft_does(tmp_path: Path) -> None:
    """PEFT puts no LoRA on a module modules_to_save names: this genuine PEFT adapter holds the
    q_proj pairs and a whole lm_head, the same as without lm_head in its targets."""
    both = make_peft_adapter(
        tmp_path / "b", target_modules=["q_proj", "lm_head"], modules_to_save=["lm_head"]
    )
    saved = make_peft_adapter(
        tmp_path / "s", target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    adapter = load(both)
    assert set(adapter.saved) == {"lm_head"} and not adapter.top
    assert adapter.digest == load(saved).digest


def test_modules_to_save_entries_match_as_plain_suffixes_as_in_peft(tmp_path: Path) -> None:
    """PEFT saves every module whose name ends with an entry: "head" saves the lm_head."""
    suffix = make_peft_adapter(tmp_path / "h", target_modules=["q_proj"], modules_to_save=["head"])
    whole = make_peft_adapter(
        tmp_path / "w", target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    adapter = load(suffix)
    assert set(adapter.saved) == {"lm_head"} and not adapter.top
    assert adapter.digest == load(whole).digest


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        # "s" also ends model.layers, which PEFT would save whole too
        ({"modules_to_save": ["s"]}, "modules_to_save_unsupported"),
        # PEFT keeps LoRA off a saved module only when the entry names it whole: both, refused
        ({"target_modules": ["q_proj", "lm_head"], "modules_to_save": ["head"]}, "invalid_config"),
        # PEFT's "No modules were targeted for adaptation"
        ({"target_modules": ["lm_head"], "modules_to_save": ["lm_head"]}, "invalid_config"),
    ],
)
def test_modules_to_save_that_peft_cannot_load_is_refused(
    tmp_path: Path, changes: dict, code: str
) -> None:
    folder = make_peft_adapter(
        tmp_path / "a", target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    edit_config(folder, **changes)
    assert refusal(folder).code == code


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_top_weights_are_refused(tmp_path: Path, value: float) -> None:
    folder = make_peft_adapter(
        tmp_path / "a", target_modules=["q_proj"], modules_to_save=["lm_head"]
    )

    def poison(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors[SAVED_HEAD][5, 7] = value
        return tensors

    edit_weights(folder, poison)
    assert refusal(folder).code == "non_finite_weights"


@pytest.mark.parametrize(
    ("change", "code"),
    [
        (lambda t: {k: v for k, v in t.items() if k != EMBED_A}, "missing_tensors"),
        (lambda t: t | {EMBED_A: torch.zeros(4, 128)}, "shape_mismatch"),
        (lambda t: t | {EMBED_A: torch.zeros(8, 128, 1)}, "shape_mismatch"),
        (lambda t: t | {EMBED_BASE: torch.zeros(128, 32)}, "shape_mismatch"),
        (lambda t: t | {SAVED_HEAD: torch.zeros(128, 64)}, "unexpected_tensors"),
        (lambda t: t | {EMBED_A.replace("_A", "_C"): torch.zeros(8, 128)}, "unexpected_tensors"),
        (
            lambda t: (
                t | {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 128)}
            ),
            "unexpected_tensors",
        ),
    ],
)
def test_damaged_embedding_files_are_refused(
    tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], code: str
) -> None:
    folder = make_peft_adapter(tmp_path / "a", target_modules=["embed_tokens"])
    edit_weights(folder, change)
    assert refusal(folder).code == code


def test_with_layers_to_transform_only_exact_names_select_the_top_modules(tmp_path: Path) -> None:
    """As PEFT: a suffix match needs a layer index, which the embedding does not have."""
    folder = make_peft_adapter(tmp_path / "a", target_modules=["q_proj"], layers_to_transform=[1])
    edit_config(folder, target_modules=["q_proj", "embed_tokens"])
    assert not load(folder).top
    edit_config(folder, target_modules=["q_proj", "model.embed_tokens"])
    assert refusal(folder).code == "missing_tensors"


def test_ensure_weight_tying_is_refused_with_top_modules(tmp_path: Path) -> None:
    folder = make_peft_adapter(
        tmp_path / "a", target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    edit_config(folder, ensure_weight_tying=True)
    assert refusal(folder).code == "unsupported_option"
    plain = make_peft_adapter(tmp_path / "p", target_modules=["q_proj"])
    edit_config(plain, ensure_weight_tying=True)  # nothing to tie: a training-time option
    assert load(plain).modules
