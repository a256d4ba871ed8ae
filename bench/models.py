"""The models benchmarks run: the demo model, a ~1.1B Llama-shaped one with seeded random
weights, or shapes only (Llama-3-8B's, for the engine's own random weights); and a result's
description of its model."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from loramux.engine.demo_model import END_OF_TEXT_ID, EOS_TOKEN_IDS, LOGIT_STD, build_demo_model

if TYPE_CHECKING:  # bench.common runs benchmarks on these models
    from bench.common import RunSettings

# Files of the demo model's folder reused as the 1B model's tokenizer and generation config.
_SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_GENERATION_CONFIG = "generation_config.json"


def prepare_model(settings: RunSettings, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The model folder to benchmark (built in `workdir` unless given) and its description."""
    if settings.model_dir is not None:
        path, name = settings.model_dir, str(settings.model_dir)
    elif settings.model_size == "demo":
        path, name = build_demo_model(workdir / "demo"), "demo (engine.demo_model, seed 0)"
    else:
        demo = build_demo_model(workdir / "demo")
        path = build_random_llama(workdir / "llama-1b", demo, settings.device)
        name = "llama-1b-random (bench.models.llama_1b_config, seed 0)"
    return path, describe_model(path, name, settings.dtype, settings.device)


def describe_model(folder: Path, name: str, dtype: str, device: str) -> dict[str, Any]:
    """A result's `model`: its name, dtype, device, architecture sizes and parameter count."""
    config = LlamaConfig.from_pretrained(folder)
    return {
        "name": name,
        "dtype": dtype,
        "device": device,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "parameters": _parameter_count(config),
    }


def _parameter_count(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def llama_1b_config() -> LlamaConfig:
    """The GPU variant's model: Llama-shaped, ~1.1B parameters (hidden 2048, 16 layers,
    32 query / 8 KV heads of 64, SwiGLU 8192, vocab 32000); its EOS and padding are the demo's."""
    return _llama_config(2048, 8192, 16, 32, 8, 64, 32000, 4096, 10000.0)


def llama3_8b_config() -> LlamaConfig:
    """Llama-3-8B's shapes (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, SwiGLU
    14336, vocab 128256, rope theta 500000); its EOS and padding are the demo tokenizer's."""
    return _llama_config(4096, 14336, 32, 32, 8, 128, 128256, 8192, 500000.0)


def _llama_config(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    max_positions: int,
    rope_theta: float,
) -> LlamaConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        hidden_act="silu",
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=list(EOS_TOKEN_IDS),
        pad_token_id=END_OF_TEXT_ID,
        dtype="bfloat16",
    )


def shapes_only_folder(config: LlamaConfig, tokenizer_dir: Path, out_dir: Path) -> Path:
    """A model folder with config.json and the demo tokenizer but no weights: the engine gives
    it seeded random ones (`EngineConfig.random_weights`). Ids past the tokenizer's vocabulary
    decode to nothing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    """The demo model's tokenizer files and generation config."""
    for file in (*_SHARED_FILES, _GENERATION_CONFIG):
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, out_dir / file)


def build_random_llama(out_dir: Path, tokenizer_dir: Path, device: str, seed: int = 0) -> Path:
    """`llama_1b_config()` with seeded random bfloat16 weights, in HF layout.

    Scaled like the demo model (embeddings N(0, 1), projections N(0, 1/fan_in), norms 1,
    lm_head std LOGIT_STD / sqrt(hidden)) so activations stay O(1) and greedy decoding has
    clear margins between the top two logits (see engine.demo_model). Weights are drawn on `device` (fast on a GPU); the tokenizer and generation
    config are the demo model's.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    config = llama_1b_config()
    config.save_pretrained(out_dir)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator(device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / math.sqrt(shape[1])
        if name == "lm_head.weight":
            std = LOGIT_STD / math.sqrt(config.hidden_size)
        drawn = torch.randn(shape, generator=generator, device=device) * std
        weights[name] = drawn.to(torch.bfloat16).cpu()
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir
