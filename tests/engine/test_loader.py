"""Loading Llama-family folders: each family's greedy output equals transformers'; others are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from loramux.engine.errors import UnsupportedModelError
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import Attention, RMSNorm
from loramux.engine.model.loader import load_model
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.kernels.rms_norm import rms_norm, rms_norm_torch
from loramux.kernels.rope_cache import rope_and_cache, rope_and_cache_torch
from tests.engine.conftest import hf_greedy, make_engine, run_to_completion

_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "vocab_size": 4096,
}


def _family(kind: str) -> Any:
    if kind == "llama3-tied":
        return LlamaConfig(
            **_SMALL,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":
        return Qwen2Config(**_SMALL, tie_word_embeddings=False)
    if kind == "mistral":
        return MistralConfig(**_SMALL, sliding_window=None)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["llama3-tied", "qwen2", "mistral"])
def test_family_greedy_equals_transformers(kind: str, demo_model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(_family(kind), dtype=torch.float32)
    with torch.no_grad():  # random biases/norms so every parameter matters
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((demo_model_dir / f).read_bytes())
    prompt = list(range(5, 70, 3))
    engine = make_engine(tmp_path, max_model_len=128, num_kv_blocks=32)
    out = run_to_completion(
        engine,
        [EngineRequest("r", SamplingParams(max_tokens=12), prompt_token_ids=prompt)],
    )
    assert [t for o in out["r"] for t in o.token_ids] == hf_greedy(model.eval(), prompt, 12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_loads_and_generates(demo_model_dir: Path, dtype: str) -> None:
    engine = make_engine(demo_model_dir, dtype=dtype)
    assert engine.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    out = run_to_completion(
        engine,
        [EngineRequest("r", SamplingParams(max_tokens=5, ignore_eos=True), prompt="def f():")],
    )
    assert sum(len(o.token_ids) for o in out["r"]) == 5


def test_other_architectures_are_refused(demo_model_dir: Path, tmp_path: Path) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_folder(tmp_path)


def test_unsupported_rope_and_pickled_weights_are_refused(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict(config)
    del config["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((demo_model_dir / f).read_bytes())
    with pytest.raises(UnsupportedModelError, match="safetensors"):
        make_engine(tmp_path)


def test_random_weights_need_only_the_config_and_tokenizer(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    shapes_only = tmp_path / "shapes-only"
    shapes_only.mkdir()
    for f in demo_model_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            (shapes_only / f.name).write_bytes(f.read_bytes())
    engines = [make_engine(shapes_only, random_weights=True) for _ in range(2)]
    first, second = (e.model.state_dict() for e in engines)
    assert first.keys() == make_engine(demo_model_dir).model.state_dict().keys()
    assert all(torch.equal(first[k], second[k]) for k in first), "seeded"
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = [
        run_to_completion(e, [EngineRequest("r", params, prompt_token_ids=[5, 6, 7])])["r"]
        for e in engines
    ]
    assert outs[0][-1].finish_reason == "length" and outs[0] == outs[1]


def test_the_fused_kernels_can_be_turned_off(demo_model_dir: Path) -> None:
    """LORAMUX_FUSED_KERNELS=0 (EngineConfig.fused_kernels): every norm and attention layer runs
    the torch forms, which the CPU always runs, so the outputs are the same here."""
    fused = load_model(demo_model_dir, torch.float32, "cpu", 64)
    plain = load_model(demo_model_dir, torch.float32, "cpu", 64, fused_kernels=False)
    norms = [m for m in plain.modules() if isinstance(m, RMSNorm)]
    attention = [m for m in plain.modules() if isinstance(m, Attention)]
    assert len(norms) == 2 * plain.config.num_layers + 1 and len(attention) > 0
    assert all(m.kernel is rms_norm_torch for m in norms)
    assert all(m.rope_and_cache is rope_and_cache_torch for m in attention)
    assert all(m.kernel is rms_norm for m in fused.modules() if isinstance(m, RMSNorm))
    assert all(
        m.rope_and_cache is rope_and_cache for m in fused.modules() if isinstance(m, Attention)
    )
