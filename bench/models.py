"""The models benchmarks run, and a result's description of its model.

`--model-size`: `demo` (engine.demo_model, 4.9M parameters: a rank-64 adapter is about as big
as the model, so its figures measure adapter weights more than the engine), `1b` (~1.1B,
Llama-shaped, for GPUs) or `realistic`: a shape where LoRA adapters cost a few percent of the
model's FLOPs, as they do in serving. On CPU that is `realistic_cpu_config()` (hidden 1024,
4 layers, ~50M parameters, float32); on CUDA Llama-3-8B's shapes (`llama3_8b_config()`).
Every model but the demo has seeded random weights in HF layout and the demo tokenizer.
Shapes only (config and tokenizer, no weights) serve the engine's own random weights.
"""

from __future__ import annotations

import math
import shutil
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import LoraConfig
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from loramux.adapters.demo import demo_lora_config
from loramux.engine.demo_model import (
    END_OF_TEXT_ID,
    EOS_TOKEN_IDS,
    LOGIT_STD,
    VOCAB_SIZE,
    build_demo_model,
)

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
        config, name = _random_model(settings)
        dtype = getattr(torch, settings.dtype)
        path = build_random_llama(workdir / "random", config, demo, settings.device, dtype)
    return path, describe_model(path, name, settings.dtype, settings.device)


def _random_model(settings: RunSettings) -> tuple[LlamaConfig, str]:
    """The config and result name of a model size other than the demo."""
    if settings.model_size == "1b":
        return llama_1b_config(), "llama-1b-random (bench.models.llama_1b_config, seed 0)"
    assert settings.model_size == "realistic", settings.model_size
    if settings.is_cuda:
        return llama3_8b_config(), "llama-3-8b-shaped random (bench.models.llama3_8b_config)"
    return realistic_cpu_config(), "realistic-cpu random (bench.models.realistic_cpu_config)"


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


def realistic_cpu_config() -> LlamaConfig:
    """The CPU `realistic` model: hidden 1024, 4 layers, 16 query / 4 KV heads of 64, SwiGLU
    2816, the demo vocabulary (4096), ~50M parameters. Wide enough that a rank-16 adapter on
    every projection is ~2.5% of its FLOPs; shallow enough that a quick benchmark run stays
    within minutes on two cores."""
    return _llama_config(1024, 2816, 4, 16, 4, 64, VOCAB_SIZE, 2048, 10000.0)


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


def build_random_llama(
    out_dir: Path,
    config: LlamaConfig,
    tokenizer_dir: Path,
    device: str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """A model of `config` with seeded random `dtype` weights, in HF layout.

    Scaled like the demo model (embeddings N(0, 1), projections N(0, 1/fan_in), norms 1,
    lm_head std LOGIT_STD / sqrt(hidden)) so activations stay O(1) and greedy decoding has
    clear margins between the top two logits (see engine.demo_model). Weights are drawn on
    `device` (fast on a GPU); the tokenizer and generation config are the demo model's.
    `config.dtype` is set to `dtype`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator(device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
            continue
        std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / math.sqrt(shape[1])
        if name == "lm_head.weight":
            std = LOGIT_STD / math.sqrt(config.hidden_size)
        drawn = torch.randn(shape, generator=generator, device=device) * std
        weights[name] = drawn.to(dtype).cpu()
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


# -- FLOPs ------------------------------------------------------------------------------------
def model_flops_per_token(config: LlamaConfig) -> int:
    """2 x every linear weight a token passes through (the layers' projections and lm_head);
    attention scores and the embedding lookup are excluded."""
    projections = sum(i * o for i, o in _projection_shapes(config).values())
    return 2 * (config.num_hidden_layers * projections + config.hidden_size * config.vocab_size)


def lora_flops_per_token(config: LlamaConfig, lora: LoraConfig) -> int:
    """2 x r x (in + out) per adapted projection and layer: x @ A then (x A) @ B."""
    shapes = _projection_shapes(config)
    targets = lora.target_modules
    assert isinstance(targets, list | set), "targets are projection names"
    per_layer = sum(2 * lora.r * sum(shapes[t]) for t in targets)
    return config.num_hidden_layers * per_layer


def demo_adapters_flops_share(
    model_dir: Path, ranks: tuple[int, ...], count: int
) -> dict[str, float]:
    """Min, median and max over demo adapters 0..count-1 (`adapters.demo`, ranks cycling
    through `ranks`) of LoRA FLOPs / the model's FLOPs."""
    config = LlamaConfig.from_pretrained(model_dir)
    base = model_flops_per_token(config)
    shares = [lora_flops_per_token(config, demo_lora_config(i, ranks)) / base for i in range(count)]
    return {"min": min(shares), "median": statistics.median(shares), "max": max(shares)}


def _projection_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one layer, by PEFT target name."""
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(config.num_key_value_heads or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
