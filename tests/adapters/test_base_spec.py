"""The base model's LoRA-relevant dimensions, read from a Hugging Face config."""

from __future__ import annotations

import pytest

from loramux.adapters.base_spec import PROJECTIONS, BaseModelSpec, ProjectionShape
from tests.adapters.peft_adapters import tiny_config, tiny_model


def test_reads_a_transformers_llama_config() -> None:
    spec = BaseModelSpec.from_hf_config(tiny_config().to_dict())
    assert spec == BaseModelSpec(
        num_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab=128,
    )


def test_projection_shapes_match_the_torch_modules() -> None:
    spec = BaseModelSpec.from_hf_config(tiny_config(head_dim=24).to_dict())
    layer = tiny_model(head_dim=24).model.layers[0]
    modules = {
        "q": layer.self_attn.q_proj,
        "k": layer.self_attn.k_proj,
        "v": layer.self_attn.v_proj,
        "o": layer.self_attn.o_proj,
        "gate": layer.mlp.gate_proj,
        "up": layer.mlp.up_proj,
        "down": layer.mlp.down_proj,
    }
    assert set(modules) == set(PROJECTIONS)
    for proj, module in modules.items():
        assert spec.projection_shape(proj) == ProjectionShape(
            module.in_features, module.out_features
        )


def test_kv_heads_and_head_dim_default_like_transformers() -> None:
    config = {
        "num_hidden_layers": 3,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 8,
        "vocab_size": 1000,
    }
    spec = BaseModelSpec.from_hf_config(config)
    assert (spec.num_kv_heads, spec.head_dim) == (8, 16)
    assert spec.projection_shape("k") == ProjectionShape(128, 128)


def test_incomplete_or_inconsistent_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="intermediate_size"):
        BaseModelSpec.from_hf_config(
            {"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2}
        )
    with pytest.raises(ValueError, match="multiple"):
        BaseModelSpec(1, 64, 96, num_heads=4, num_kv_heads=3, head_dim=16, vocab=10)
    with pytest.raises(ValueError, match="positive"):
        BaseModelSpec(0, 64, 96, num_heads=4, num_kv_heads=2, head_dim=16, vocab=10)
