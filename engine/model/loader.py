"""Load a local Hugging Face Llama-family folder (safetensors) into `LlamaModel`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import UnsupportedModelError
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel
from engine.model.rope import RotaryEmbedding

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


def load_model(folder: Path, dtype: torch.dtype, device: str, max_len: int) -> LlamaModel:
    """Build the model from `folder`'s config and weights. Raises UnsupportedModelError."""
    config = ModelConfig.from_folder(folder)
    tensors = _fuse(_read_checkpoint(folder), config.num_layers)
    if "lm_head.weight" in tensors and config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    tensors = {k: v for k, v in tensors.items() if "rotary_emb" not in k}
    rope = RotaryEmbedding(config, max_len, dtype)
    with torch.device("meta"):
        model = LlamaModel(config, rope)
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - tensors.keys(), tensors.keys() - expected
    if missing or unexpected:
        raise UnsupportedModelError(
            f"checkpoint does not match a {config.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, assign=True)
    return model.to(device).eval()
