"""Every kind of bad adapter is refused with its own error code, from a real folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import IA3Config, get_peft_model

from loramux.adapters import errors
from loramux.adapters.errors import AdapterError
from loramux.adapters.peft_format import AdapterLimits, load_peft_adapter
from tests.adapters.peft_adapters import (
    edit_config,
    edit_weights,
    lora_key,
    make_peft_adapter,
    tiny_base,
    tiny_model,
)


def refusal(folder: Path, limits: AdapterLimits | None = None) -> AdapterError:
    with pytest.raises(AdapterError) as raised:
        load_peft_adapter(folder, tiny_base(), limits)
    assert str(raised.value) == raised.value.message != ""
    return raised.value


def test_codes_are_unique_and_stable() -> None:
    kinds = [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, AdapterError) and cls is not AdapterError
    ]
    codes = [cls.code for cls in kinds]
    assert len(set(codes)) == len(codes)
    assert all(code.isidentifier() and code.islower() for code in codes)


def test_ia3_is_not_lora(tmp_path: Path) -> None:
    config = IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    get_peft_model(tiny_model(), config).save_pretrained(tmp_path / "a")
    assert refusal(tmp_path / "a").code == "not_lora"


def test_pickled_bin_weights(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", safe_serialization=False)
    assert (folder / "adapter_model.bin").exists()
    error = refusal(folder)
    assert error.code == "pickled_weights"
    assert "adapter_model.bin" in error.message


def test_pickle_beside_safetensors_is_refused_too(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    torch.save({"x": torch.zeros(1)}, folder / "extra.pt")
    assert refusal(folder).code == "pickled_weights"


@pytest.mark.parametrize(
    ("lora_kwargs", "code"),
    [
        ({"modules_to_save": ["norm"]}, "modules_to_save_unsupported"),
        ({"modules_to_save": ["q_proj"]}, "modules_to_save_unsupported"),
        ({"target_modules": ["embed_tokens"], "use_dora": True}, "dora_unsupported"),
        ({"target_modules": ["lm_head", "q_proj"], "use_dora": True}, "dora_unsupported"),
        ({"r": 128, "lora_alpha": 128}, "rank_over_limit"),
        ({"rank_pattern": {"q_proj": 4}}, "unsupported_option"),
        ({"alpha_pattern": {"v_proj": 32}}, "unsupported_option"),
        ({"bias": "all"}, "bias_unsupported"),
        ({"bias": "lora_only"}, "bias_unsupported"),
        ({"lora_bias": True}, "bias_unsupported"),
        ({"target_modules": r".*\.q_proj"}, "target_pattern_unsupported"),
        ({"layer_replication": [[0, 2]]}, "unsupported_option"),
    ],
)
def test_peft_options_beyond_plain_lora(tmp_path: Path, lora_kwargs: dict, code: str) -> None:
    folder = make_peft_adapter(tmp_path / "a", **lora_kwargs)
    assert refusal(folder).code == code


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"target_modules": ["q_proj", "fc1"]}, "unknown_target_module"),
        ({"target_modules": ["self_attn"]}, "unknown_target_module"),
        ({"target_modules": []}, "invalid_config"),
        ({"target_modules": None}, "invalid_config"),
        ({"exclude_modules": ".*q_proj"}, "target_pattern_unsupported"),
        ({"r": "8"}, "invalid_config"),
        ({"r": 0}, "invalid_config"),
        ({"lora_alpha": None}, "invalid_config"),
        ({"use_rslora": "yes"}, "invalid_config"),
        ({"layers_to_transform": "first"}, "invalid_config"),
        ({"layers_to_transform": [0], "layers_pattern": "h"}, "unsupported_option"),
        ({"peft_type": "LOHA"}, "not_lora"),
        ({"use_qalora": True}, "unsupported_option"),
        ({"some_future_variant": {"enabled": True}}, "unsupported_option"),
    ],
)
def test_config_fields_are_checked(tmp_path: Path, changes: dict, code: str) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    edit_config(folder, **changes)
    assert refusal(folder).code == code


@pytest.mark.parametrize(
    "init", ["pissa", "pissa_niter_4", "olora", "OLoRA", "corda", "loftq", "lora_ga"]
)
def test_an_initialisation_that_changes_the_base_weights_is_refused(
    tmp_path: Path, init: str
) -> None:
    """PEFT re-runs such an initialisation when it loads the adapter: it rewrites every targeted
    base weight to W - scaling * B0 @ A0 before reading A and B. One base model serves every
    adapter, so these are refused, not served as W + scaling * B @ A."""
    folder = make_peft_adapter(tmp_path / "a")
    edit_config(folder, init_lora_weights=init, loftq_config={"loftq_bits": 4, "loftq_iter": 1})
    error = refusal(folder)
    assert error.code == "unsupported_option"
    assert "init_lora_weights" in error.message and "base weights" in error.message


@pytest.mark.parametrize("init", ["unknown", 1, ["pissa"]])
def test_an_unknown_initialisation_is_refused(tmp_path: Path, init: object) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    edit_config(folder, init_lora_weights=init)
    assert refusal(folder).code == "unsupported_option"


@pytest.mark.parametrize("init", [True, False, None, "gaussian", "eva", "orthogonal", "mica"])
def test_an_initialisation_that_keeps_the_base_weights_is_plain_lora(
    tmp_path: Path, init: object
) -> None:
    """The saved A and B replace what these set first: the same adapter, the same digest; their
    *_config fields (ignored by PEFT for other modes) change nothing either."""
    folder = make_peft_adapter(tmp_path / "a")
    plain = load_peft_adapter(folder, tiny_base())
    edit_config(
        folder,
        init_lora_weights=init,
        eva_config={"rho": 2.0},
        corda_config={"corda_method": "kpm"},
        loftq_config={},
        lora_ga_config={"direction": "ArB2r"},
    )
    assert load_peft_adapter(folder, tiny_base()).digest == plain.digest


def test_an_option_named_with_a_lone_surrogate_is_named_escaped(tmp_path: Path) -> None:
    """JSON may name an option with a lone surrogate (`"\\udc80x"`): it is an unsupported
    option, its name escaped in the message, which UTF-8 then carries (the raw name made the
    gateway's answer unwritable: a 500)."""
    folder = make_peft_adapter(tmp_path / "a")
    edit_config(folder, **{"\udc80x": 1})
    error = refusal(folder)
    assert error.code == "unsupported_option"
    assert "\\udc80x" in error.message.encode().decode()


def test_rank_limit_is_configurable(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", r=128, lora_alpha=128)
    assert load_peft_adapter(folder, tiny_base(), AdapterLimits(max_rank=128)).rank == 128
    assert refusal(folder, AdapterLimits(max_rank=64)).code == "rank_over_limit"


def test_adapter_for_another_base_model_is_a_shape_mismatch(tmp_path: Path) -> None:
    other = tiny_model(hidden_size=128, intermediate_size=160, head_dim=32)
    folder = make_peft_adapter(tmp_path / "a", model=other)
    error = refusal(folder)
    assert error.code == "shape_mismatch"
    assert "[8, 128]" in error.message


def test_weights_of_another_rank_are_a_shape_mismatch(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", r=8)
    edit_config(folder, r=4)
    assert refusal(folder).code == "shape_mismatch"


def test_layers_beyond_the_base_model_are_unexplained(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", model=tiny_model(num_hidden_layers=3))
    assert refusal(folder).code == "unexpected_tensors"


def test_tensor_the_config_does_not_target(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a", target_modules=["q_proj", "v_proj"])
    edit_config(folder, target_modules=["q_proj"])
    error = refusal(folder)
    assert error.code == "unexpected_tensors"
    assert "v_proj" in error.message


@pytest.mark.parametrize(
    "extra",
    [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias",
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",
        "base_model.model.model.layers.00.self_attn.q_proj.lora_A.weight",
        pytest.param(  # int() refuses a layer index of 5,000 digits (a ValueError, a 500)
            "base_model.model.model.layers." + "9" * 5000 + ".self_attn.q_proj.lora_A.weight",
            id="layer index of 5000 digits",
        ),
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight",  # duplicate of the A
    ],
)
def test_extra_tensors_are_refused(tmp_path: Path, extra: str) -> None:
    folder = make_peft_adapter(tmp_path / "a", target_modules=["q_proj"])
    edit_weights(folder, lambda tensors: tensors | {extra: torch.zeros(8, 64)})
    assert refusal(folder).code == "unexpected_tensors"


def test_missing_half_of_a_pair(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    missing = lora_key(1, "v", "B")
    edit_weights(folder, lambda tensors: {k: v for k, v in tensors.items() if k != missing})
    error = refusal(folder)
    assert error.code == "missing_tensors"
    assert "layers.1.v.lora_B" in error.message


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights(tmp_path: Path, value: float) -> None:
    folder = make_peft_adapter(tmp_path / "a")

    def poison(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors[lora_key(0, "q", "A")][2, 5] = value
        return tensors

    edit_weights(folder, poison)
    assert refusal(folder).code == "non_finite_weights"


def test_scaling_that_overflows_b_is_non_finite(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    edit_config(folder, lora_alpha=1e300)
    assert refusal(folder).code == "non_finite_weights"


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unsupported_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    edit_weights(folder, lambda tensors: {k: v.to(dtype) for k, v in tensors.items()})
    assert refusal(folder).code == "unsupported_dtype"


def test_file_over_size_limit(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    size = (folder / "adapter_model.safetensors").stat().st_size
    assert refusal(folder, AdapterLimits(max_file_bytes=size - 1)).code == "file_too_large"
    assert load_peft_adapter(folder, tiny_base(), AdapterLimits(max_file_bytes=size)).rank == 8


def test_oversized_config(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    edit_config(folder, padding="x" * (1 << 20))
    assert refusal(folder).code == "file_too_large"


@pytest.mark.parametrize(
    "content", ["{not json", "[1, 2]", "\udcff".encode("utf-8", "surrogatepass")]
)
def test_malformed_config(tmp_path: Path, content: str | bytes) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    path = folder / "adapter_config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert refusal(folder).code == "invalid_config"


def test_missing_config(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    (folder / "adapter_config.json").unlink()
    assert refusal(folder).code == "missing_config"


def test_not_a_folder(tmp_path: Path) -> None:
    assert refusal(tmp_path / "nowhere").code == "missing_config"


def test_missing_safetensors(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").unlink()
    assert refusal(folder).code == "missing_weights"


@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}xx"])
def test_corrupt_safetensors(tmp_path: Path, content: bytes) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").write_bytes(content)
    assert refusal(folder).code == "invalid_weights"


def test_symlinked_weights(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    weights.rename(tmp_path / "elsewhere.safetensors")
    weights.symlink_to(tmp_path / "elsewhere.safetensors")
    assert refusal(folder).code == "unsafe_file"


@pytest.mark.parametrize(
    ("field", "literal"),
    [("lora_alpha", "1" + "0" * 400), ("lora_alpha", "9" * 5000), ("r", "9" * 5000)],
    ids=["alpha past float", "alpha of 5000 digits", "r of 5000 digits"],
)
def test_huge_integers_in_the_config(tmp_path: Path, field: str, literal: str) -> None:
    """JSON integers are unbounded: one past a float's range is not a finite alpha, and one
    past Python's 4300-digit limit cannot be read at all. Both are invalid_config; they were
    an OverflowError from math.isfinite and a ValueError from json.loads (an HTTP 500)."""
    folder = make_peft_adapter(tmp_path / "a")
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config[field] = "huge"
    path.write_text(json.dumps(config).replace('"huge"', literal))
    assert refusal(folder).code == "invalid_config"


def test_config_must_be_an_object_with_peft_type(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    assert refusal(folder).code == "not_lora"


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000 + "]" * 100_000,  # past the JSON parser's recursion limit
        '{"peft_type": "LORA", "r": 8, "extra": ' + "[" * 900 + "]" * 900 + "}",
        '{"peft_type": "LORA", "r": 8, "extra": ' + '{"a": ' * 33 + "1" + "}" * 34,
    ],
    ids=["100k deep", "900 deep", "33 deep"],
)
def test_deeply_nested_config(tmp_path: Path, content: str) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    (folder / "adapter_config.json").write_text(content)
    error = refusal(folder)
    assert error.code == "invalid_config"
    assert "nested" in error.message


def test_config_nesting_up_to_the_limit_is_read(tmp_path: Path) -> None:
    folder = make_peft_adapter(tmp_path / "a")
    edit_config(folder, eva_config={"a": [[{"b": [[1]]}]]})
    assert load_peft_adapter(folder, tiny_base()).rank == 8
