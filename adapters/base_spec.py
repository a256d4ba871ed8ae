"""The base model's shape, as far as LoRA adapters are concerned.

An adapter is compatible with a base model when every LoRA pair matches the (in, out)
features of the projection it targets. Projections are named by their role, without
PEFT's `_proj` suffix: q, k, v, o (attention), gate, up, down (SwiGLU MLP).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

PROJECTIONS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
"""Every projection a LoRA adapter may target, in the engine's canonical order."""


class ProjectionShape(NamedTuple):
    """A linear projection y = x @ W.T with W of shape [out_features, in_features]."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class BaseModelSpec:
    """The dimensions of a Llama-family base model that decide LoRA shapes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    def __post_init__(self) -> None:
        fields = (
            self.num_layers,
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab,
        )
        if any(value < 1 for value in fields):
            raise ValueError(f"every dimension must be positive: {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of {self.num_kv_heads}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> BaseModelSpec:
        """Read a Hugging Face Llama `config.json` dict (num_key_value_heads and head_dim optional)."""
        try:
            num_heads = int(config["num_attention_heads"])
            hidden_size = int(config["hidden_size"])
            head_dim = config.get("head_dim") or hidden_size // num_heads
            return cls(
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden_size,
                intermediate_size=int(config["intermediate_size"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                vocab=int(config["vocab_size"]),
            )
        except KeyError as missing:
            raise ValueError(f"model config lacks {missing.args[0]!r}") from None

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> BaseModelSpec:
        """Read `config.json` of a Hugging Face model folder."""
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def projection_shape(self, projection: str) -> ProjectionShape:
        """(in_features, out_features) of one projection; KeyError for an unknown name."""
        return self._projection_shapes()[projection]

    def _projection_shapes(self) -> dict[str, ProjectionShape]:
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        hidden, inter = self.hidden_size, self.intermediate_size
        return {
            "q": ProjectionShape(hidden, q_out),
            "k": ProjectionShape(hidden, kv_out),
            "v": ProjectionShape(hidden, kv_out),
            "o": ProjectionShape(q_out, hidden),
            "gate": ProjectionShape(hidden, inter),
            "up": ProjectionShape(hidden, inter),
            "down": ProjectionShape(inter, hidden),
        }
