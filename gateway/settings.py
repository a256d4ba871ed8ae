"""One settings object for every process, read from `LORAMUX_*` environment variables.

Every field has an embedded default that needs nothing configured: data under `./.loramux`, the
demo model built there on first start, the engine in-process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def _env(name: str, default: Any, cast: type = str) -> Any:
    raw = os.environ.get(f"LORAMUX_{name}")
    if raw is None or raw == "":
        return default
    if cast is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return cast(raw)


@dataclass(frozen=True)
class EngineSettings:
    dtype: str = field(default_factory=lambda: _env("DTYPE", "float32"))
    """LORAMUX_DTYPE: float32, float16 or bfloat16."""
    device: str = field(default_factory=lambda: _env("DEVICE", "cpu"))
    """LORAMUX_DEVICE: torch device of the in-process engine (cpu, cuda, cuda:1)."""
    kv_cache_mb: int = field(default_factory=lambda: _env("KV_CACHE_MB", 256, int))
    """LORAMUX_KV_CACHE_MB: memory budget of the paged KV cache."""
    max_num_seqs: int = field(default_factory=lambda: _env("MAX_NUM_SEQS", 64, int))
    """LORAMUX_MAX_NUM_SEQS: sequences running in one step at most."""
    max_num_batched_tokens: int = field(
        default_factory=lambda: _env("MAX_BATCHED_TOKENS", 512, int)
    )
    """LORAMUX_MAX_BATCHED_TOKENS: token budget per step (decode tokens plus prefill chunks)."""
    max_model_len: int | None = field(default_factory=lambda: _env("MAX_MODEL_LEN", None, int))
    """LORAMUX_MAX_MODEL_LEN: longest prompt plus completion; the model's context by default."""


@dataclass(frozen=True)
class Settings:
    data_dir: Path = field(default_factory=lambda: Path(_env("DATA_DIR", "./.loramux")).resolve())
    """LORAMUX_DATA_DIR: where the database, adapters, secrets and the demo model live."""
    model: Path | None = field(default_factory=lambda: _env("MODEL", None, Path))
    """LORAMUX_MODEL: a Hugging Face folder of a Llama-family model; the demo model when unset."""
    engine: EngineSettings = field(default_factory=EngineSettings)

    @property
    def model_dir(self) -> Path:
        return self.model if self.model is not None else self.data_dir / "demo-model"

    def describe(self) -> dict[str, Any]:
        """Settings as plain values, for logs and `/ready`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.__dict__ if hasattr(value, "__dataclass_fields__") else str(value)
        return out
