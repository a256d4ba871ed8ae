"""Genuine PEFT adapter folders for tests, made by the peft library on a tiny Llama.

The tiny model has GQA (4 query heads, 2 KV heads) and distinct widths everywhere, so a
transposed or misplaced LoRA weight cannot go unnoticed. Helpers that damage a folder do it
the way a careless user would: by editing the JSON or re-saving the safetensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from loramux.adapters.base_spec import BaseModelSpec


def tiny_config(**overrides: Any) -> LlamaConfig:
    """2 layers, hidden 64, 4 heads of 16, 2 KV heads, intermediate 96, vocab 128."""
    fields: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
    }
    return LlamaConfig(**(fields | overrides))


def tiny_base(**overrides: Any) -> BaseModelSpec:
    return BaseModelSpec.from_hf_config(tiny_config(**overrides).to_dict())


def tiny_model(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides)).eval()


def make_peft_adapter(
    folder: Path,
    *,
    seed: int = 0,
    model: LlamaForCausalLM | None = None,
    dtype: torch.dtype | None = None,
    safe_serialization: bool = True,
    **lora_kwargs: Any,
) -> Path:
    """Save a PEFT LoRA adapter with seeded, non-zero A and B into `folder`.

    `lora_kwargs` go to `LoraConfig` (default: r=8, lora_alpha=16, q_proj + v_proj).
    """
    kwargs: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    config = LoraConfig(init_lora_weights=False, **(kwargs | lora_kwargs))
    peft_model = get_peft_model(model if model is not None else tiny_model(), config)
    fill_lora_weights(peft_model, seed)
    if dtype is not None:
        peft_model.to(dtype)
    peft_model.save_pretrained(folder, safe_serialization=safe_serialization)
    return folder


@torch.no_grad()
def fill_lora_weights(peft_model: PeftModel, seed: int) -> None:
    """Overwrite every LoRA parameter (A, B, embedding pairs, biases) with seeded N(0, 0.1)."""
    generator = torch.Generator().manual_seed(seed)
    for name, weights in sorted(peft_model.named_parameters(), key=lambda item: item[0]):
        if ".lora_" in name:
            weights.copy_(torch.randn(weights.shape, generator=generator) * 0.1)


def edit_config(folder: Path, **changes: Any) -> None:
    """Set fields of adapter_config.json (None values are written as JSON null)."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_weights(
    folder: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> None:
    """Re-save adapter_model.safetensors with `change` applied to its tensors."""
    save_weights(folder, change(load_weights(folder)))


def lora_key(layer: int, proj: str, half: str) -> str:
    """PEFT's saved name of a LoRA weight of the tiny model."""
    parent = "mlp" if proj in ("gate", "up", "down") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{parent}.{proj}_proj.lora_{half}.weight"


def save_weights(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


class HfBaseWeights:
    """A Hugging Face Llama's weights as adapters.peft_top.BaseWeights."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.state = model.state_dict()

    def projection_weight(self, layer: int, proj: str) -> torch.Tensor:
        parent = "mlp" if proj in ("gate", "up", "down") else "self_attn"
        return self.state[f"model.layers.{layer}.{parent}.{proj}_proj.weight"]

    def top_weight(self, module: str) -> torch.Tensor:
        name = "model.embed_tokens.weight" if module == "embed_tokens" else "lm_head.weight"
        return self.state[name]
