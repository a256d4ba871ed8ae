"""Load a local Hugging Face Llama-family folder (safetensors) into `LlamaModel`, or give a
folder's architecture seeded random weights (benchmarks of shapes that exist only as a config)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from loramux.engine.demo_model import LOGIT_STD
from loramux.engine.errors import UnsupportedModelError
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LlamaModel
from loramux.engine.model.rope import RotaryEmbedding

# Checkpoint projection names fused into one of our parameters, in output order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise UnsupportedModelError(
            f"{folder} holds pickled weights; loramux loads safetensors only"
        )
    raise UnsupportedModelError(f"{folder} has no model.safetensors")


def _read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                key = name.removeprefix("model.")
                tensors[key] = f.get_tensor(name)
    return tensors


def _fuse(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    for i in range(num_layers):
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"layers.{i}.{p}.{kind}" for p in parts]
                if all(n in tensors for n in names):
                    tensors[f"layers.{i}.{fused}.{kind}"] = torch.cat(
                        [tensors.pop(n) for n in names]
                    )
    return tensors


def load_model(
    folder: Path,
    dtype: torch.dtype,
    device: str,
    max_len: int,
    random_weights: bool = False,
    fused_kernels: bool = True,
) -> LlamaModel:
    """Build the model from `folder`'s config and weights (seeded random ones instead with
    `random_weights`; the torch forms of the fused kernels without `fused_kernels`). Raises
    UnsupportedModelError."""
    config = ModelConfig.from_folder(folder)
    rope = RotaryEmbedding(config, max_len, dtype)
    with torch.device("meta"):
        model = LlamaModel(config, rope, fused_kernels)
    if random_weights:
        tensors = _random_weights(model, dtype, torch.device(device))
    else:
        tensors = _checkpoint_weights(folder, config)
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - tensors.keys(), tensors.keys() - expected
    if missing or unexpected:
        raise UnsupportedModelError(
            f"checkpoint does not match a {config.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, assign=True)
    return model.to(device).eval()


def _checkpoint_weights(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = _fuse(_read_checkpoint(folder), config.num_layers)
    if "lm_head.weight" in tensors and config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return {k: v for k, v in tensors.items() if "rotary_emb" not in k}


def _random_weights(
    model: LlamaModel, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Seeded weights drawn on `device`, scaled as the demo model's (engine.demo_model):
    embeddings N(0, 1), projections N(0, 1/fan_in), norms 1, biases 0, lm_head N(0,
    LOGIT_STD^2 / hidden), so activations stay O(1) and greedy choices have clear margins."""
    generator = torch.Generator(device).manual_seed(seed)
    hidden = model.config.hidden_size
    weights: dict[str, torch.Tensor] = {}
    for name, meta in sorted(model.state_dict().items()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(meta.shape, dtype=dtype, device=device)
        elif name.endswith("bias"):
            weights[name] = torch.zeros(meta.shape, dtype=dtype, device=device)
        else:
            std = {"embed_tokens.weight": 1.0, "lm_head.weight": LOGIT_STD / math.sqrt(hidden)}
            scale = std.get(name, 1.0 / math.sqrt(meta.shape[1]))
            drawn = torch.randn(meta.shape, generator=generator, device=device) * scale
            weights[name] = drawn.to(dtype)
    return weights
