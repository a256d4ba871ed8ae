"""Demo adapters: genuine PEFT LoRA adapters for the demo model, made by the peft library.

They exercise what the engine must handle: ranks 8/16/32/64 (or a cycle of ranks the
caller chooses, e.g. smaller ones for a wider model), different target sets (all seven
projections, attention only, MLP only, q/v only, o/down only), plain and rsLoRA scaling.
Adapter i is a pure function of (seed, ranks, i), whatever the count, so `adapter-003` is the
same file in every build.

Weights: A ~ N(0, 1/in_features); B random, then rescaled per module so the folded delta
scaling * B @ A has a Frobenius norm of 0.4-0.8 times the base weight's. That is large
enough that every adapter changes the demo model's greedy output from the first generated
token on, and small enough that activations stay O(1).

DoRA variants (`dora=True`): the same configs and A, B with `use_dora`, and each module's
magnitude set to the merged weight's row norms times a seeded factor in DORA_MAGNITUDE_SPREAD,
so the DoRA scale (adapters.dora) moves every output channel by up to that much: a DoRA
adapter served as plain LoRA, or with a wrong scale, gives other tokens.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM

from loramux.adapters.base_spec import PROJECTIONS

logger = logging.getLogger(__name__)

DEMO_RANKS = (8, 16, 32, 64)
DEMO_TARGET_SETS: tuple[tuple[str, ...], ...] = (
    PROJECTIONS,
    ("q", "k", "v", "o"),
    ("gate", "up", "down"),
    ("q", "v"),
    ("o", "down"),
)
"""Cycled with the ranks (coprime lengths), so any 20 consecutive adapters cover every pair."""
DELTA_NORM_RATIO = (0.4, 0.8)
DORA_MAGNITUDE_SPREAD = (0.7, 1.3)
_LORA_A, _LORA_B = "lora_A.default.weight", "lora_B.default.weight"
_MAGNITUDE = "lora_magnitude_vector.default.weight"


def build_demo_adapters(
    model_dir: Path,
    out_dir: Path,
    count: int,
    seed: int = 0,
    ranks: tuple[int, ...] = DEMO_RANKS,
    dora: bool = False,
) -> list[Path]:
    """Write `count` PEFT adapters `out_dir/adapter-000`, … for the model in `model_dir`,
    their ranks cycling through `ranks` (DoRA adapters with `dora`).

    Each folder is what `PeftModel.save_pretrained` writes: adapter_config.json,
    adapter_model.safetensors and a README.md. Returns the folders in order.
    """
    if count < 0:
        raise ValueError(f"count must be non-negative, not {count}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model: torch.nn.Module = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    folders = []
    for index in range(count):
        folder = out_dir / f"adapter-{index:03d}"
        config = demo_lora_config(index, ranks)
        config.use_dora = dora
        peft_model = get_peft_model(model, config, adapter_name="default")
        _randomize(peft_model, _scaling(config), _generator(seed, index))
        peft_model.save_pretrained(str(folder), safe_serialization=True)
        model = peft_model.unload()  # the base model again, for the next adapter
        folders.append(folder)
        logger.debug("wrote demo adapter %s", folder)
    return folders


def demo_lora_config(index: int, ranks: tuple[int, ...] = DEMO_RANKS) -> LoraConfig:
    """The config of demo adapter `index`: rank (from `ranks`), targets, alpha and rsLoRA cycle
    independently."""
    if not ranks or min(ranks) < 1:
        raise ValueError(f"ranks must be positive, not {ranks}")
    rank = ranks[index % len(ranks)]
    targets = DEMO_TARGET_SETS[index % len(DEMO_TARGET_SETS)]
    return LoraConfig(
        r=rank,
        lora_alpha=(16, 32)[index % 2],
        use_rslora=index % 3 == 2,
        target_modules=[f"{proj}_proj" for proj in targets],
        init_lora_weights=False,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _scaling(config: LoraConfig) -> float:
    """PEFT's LoRA scaling: alpha / sqrt(r) with rsLoRA, alpha / r otherwise."""
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def _generator(seed: int, index: int) -> torch.Generator:
    """An independent stream per (seed, index)."""
    digest = hashlib.sha256(f"loramux-demo-adapter:{seed}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def _randomize(model: PeftModel, scaling: float, generator: torch.Generator) -> None:
    """Seeded A and B for every LoRA layer, B rescaled to the adapter's delta-norm ratio."""
    low, high = DELTA_NORM_RATIO
    ratio = low + (high - low) * torch.rand((), generator=generator).item()
    params = dict(model.named_parameters())
    for name in sorted(params):
        if not name.endswith(_LORA_A):
            continue
        prefix = name.removesuffix(_LORA_A)
        lora_a, lora_b = params[name], params[prefix + _LORA_B]
        base_weight = params[prefix + "base_layer.weight"]
        a = torch.randn(lora_a.shape, generator=generator) / base_weight.shape[1] ** 0.5
        b = torch.randn(lora_b.shape, generator=generator)
        delta_norm = torch.linalg.matrix_norm(scaling * b @ a)
        b *= ratio * torch.linalg.matrix_norm(base_weight) / delta_norm
        lora_a.copy_(a)
        lora_b.copy_(b)
        magnitude = params.get(prefix + _MAGNITUDE)
        if magnitude is not None:
            low, high = DORA_MAGNITUDE_SPREAD
            factor = low + (high - low) * torch.rand(magnitude.shape, generator=generator)
            merged = base_weight + scaling * b @ a
            magnitude.copy_(torch.linalg.vector_norm(merged, dim=1) * factor)
