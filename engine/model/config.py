"""The architecture facts the engine needs, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loramux.engine.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def context_limit(self, asked: int | None) -> int:
        """The longest sequence served: `asked` (None: the model's), at most the model's
        position embeddings and its sliding window."""
        limit = min(asked or self.max_position_embeddings, self.max_position_embeddings)
        return limit if self.sliding_window is None else min(limit, self.sliding_window)

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(
                f"{folder} has no config.json: not a Hugging Face model folder"
            )
        raw = json.loads(path.read_text())
        config = cls.from_dict(raw)
        return _with_generation_eos(config, folder)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or raw.get('model_type')!r} is not supported; "
                f"loramux serves {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        heads = raw["num_attention_heads"]
        rope = _rope_parameters(raw)
        qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if qwen2 else bool(raw.get("attention_bias", False)),
            o_bias=False if qwen2 else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=_as_ids(eos),
            sliding_window=raw.get("sliding_window")
            if raw.get("use_sliding_window", True)
            else None,
        )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params["rope_theta"] = raw.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (default, linear, llama3)"
        )
    params["rope_type"] = rope_type
    params.pop("type", None)
    return params


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _with_generation_eos(config: ModelConfig, folder: Path) -> ModelConfig:
    """generation_config.json may list more EOS ids (e.g. an end-of-turn token)."""
    gen = folder / "generation_config.json"
    if not gen.is_file():
        return config
    extra = _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
    merged = tuple(dict.fromkeys(config.eos_token_ids + extra))
    return ModelConfig(**{**config.__dict__, "eos_token_ids": merged})
