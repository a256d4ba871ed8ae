"""The token embedding and the lm_head in a PEFT adapter: LoRA pairs on them, the copies of
their base weights PEFT saves beside such pairs, and whole replacements (`modules_to_save`).

File keys (PEFT 0.21 `save_pretrained` of a LlamaForCausalLM; `model.` is absent before
`embed_tokens` when the adapter was made on the bare LlamaModel):

    …model.embed_tokens.lora_embedding_A   [r, vocab]      embed(ids) + A.T[ids] @ B.T * scaling
    …model.embed_tokens.lora_embedding_B   [hidden, r]
    …lm_head.lora_A.weight                 [r, hidden]     lm_head(h) + h @ A.T @ B.T * scaling
    …lm_head.lora_B.weight                 [vocab, r]
    …model.embed_tokens.base_layer.weight  [vocab, hidden] PEFT saves the base weight of an
    …lm_head.base_layer.weight             [vocab, hidden] adapted embedding or lm_head: it must
                                                           equal the base model's, and is dropped
    …model.embed_tokens.weight             [vocab, hidden] modules_to_save: the adapter's own
    …lm_head.weight                        [vocab, hidden] copy, which replaces the base module's

Inside loramux these are `embed_tokens.lora_A`, `…lora_B`, `…base`, `…saved` (and lm_head's). A
vocabulary dimension other than the base model's means the adapter adds (or drops) tokens:
refused until the tokenizer side supports it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

import torch

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.errors import (
    AddedTokensUnsupported,
    BaseWeightsDiffer,
    MissingTensors,
    NonFiniteWeights,
    ShapeMismatch,
    UnexpectedTensors,
)
from loramux.adapters.peft_config import LoraSettings
from loramux.adapters.weights import LoraWeights

_KEYS = (
    re.compile(
        r"base_model\.model\.(?:model\.)?(embed_tokens)\."
        r"(lora_embedding_A|lora_embedding_B|base_layer\.weight|weight)"
    ),
    re.compile(
        r"base_model\.model\.(lm_head)\.(lora_A\.weight|lora_B\.weight|base_layer\.weight|weight)"
    ),
)
_PART = {
    "lora_embedding_A": "lora_A",
    "lora_embedding_B": "lora_B",
    "lora_A.weight": "lora_A",
    "lora_B.weight": "lora_B",
    "base_layer.weight": "base",
    "weight": "saved",
}

TopKey = tuple[str, str]
"""(module, part): module "embed_tokens" or "lm_head"; part lora_A, lora_B, base or saved."""


class BaseWeights(Protocol):
    """The base model's weights an adapter is checked against and DoRA's scales computed from,
    in any dtype on any device."""

    def projection_weight(self, layer: int, proj: str) -> torch.Tensor:
        """[out_features, in_features] of one projection."""
        ...

    def top_weight(self, module: str) -> torch.Tensor:
        """[vocab, hidden] of "embed_tokens" or "lm_head"."""
        ...


def top_name(key: TopKey) -> str:
    return f"{key[0]}.{key[1]}"


def check_vocabulary(shapes: dict[str, list[int]], base: BaseModelSpec) -> None:
    """Refuse an adapter whose embedding or lm_head tensors, whatever PEFT named them (a resized
    model's adapter also holds `modules_to_save.weight` and `original_module.weight` copies), have
    another vocabulary size than the base model's."""
    for key, shape in shapes.items():
        vocab = _vocabulary_size(key, shape)
        if vocab is not None and vocab != base.vocab:
            raise AddedTokensUnsupported(
                f"{key[:120]} has a vocabulary of {vocab} tokens, the base model {base.vocab}: "
                "adapters that add tokens are not supported yet"
            )


def _vocabulary_size(key: str, shape: list[int]) -> int | None:
    """The vocabulary dimension of an embedding or lm_head tensor; None for other tensors."""
    if len(shape) != 2 or key.endswith(("lora_embedding_B", "lora_A.weight")):
        return None
    if ".embed_tokens." in key and key.endswith("lora_embedding_A"):
        return shape[1]  # [r, vocab]
    if (".embed_tokens." in key or ".lm_head." in key) and key.endswith("weight"):
        return shape[0]  # lm_head's lora_B [vocab, r], and every [vocab, hidden] copy
    return None


def match_top_keys(
    keys: Iterable[str], settings: LoraSettings
) -> tuple[dict[TopKey, str], list[str]]:
    """Map the embedding's and lm_head's tensors to their file keys; the other keys are returned
    for the layers' matcher. Refuses tensors the config does not explain and missing ones."""
    found: dict[TopKey, str] = {}
    rest: list[str] = []
    unexpected: list[str] = []
    for key in keys:
        match = next((m for pattern in _KEYS if (m := pattern.fullmatch(key))), None)
        if match is None:
            rest.append(key)
            continue
        module, part = match[1], _PART[match[2]]
        allowed = settings.saved if part == "saved" else settings.top
        if module not in allowed or (module, part) in found:
            unexpected.append(key)
            continue
        found[module, part] = key
    if unexpected:
        raise UnexpectedTensors(
            f"{len(unexpected)} tensor(s) the config does not explain, e.g. {unexpected[:3]}"
        )
    needed = [(m, p) for m in sorted(settings.top) for p in ("lora_A", "lora_B")]
    needed += [(m, "saved") for m in sorted(settings.saved)]
    missing = [top_name(k) for k in needed if k not in found]
    if missing:
        raise MissingTensors(f"{len(missing)} weight(s) are missing, e.g. {missing[:3]}")
    return found, rest


def check_top_shape(key: TopKey, shape: list[int], rank: int, base: BaseModelSpec) -> None:
    """Each tensor's shape (its vocabulary size is `check_vocabulary`'s)."""
    vocab, hidden = base.vocab, base.hidden_size
    module, part = key
    if part in ("base", "saved"):
        expected = [vocab, hidden]
    elif module == "embed_tokens":
        expected = [rank, vocab] if part == "lora_A" else [hidden, rank]
    else:
        expected = [rank, hidden] if part == "lora_A" else [vocab, rank]
    if shape != expected:
        raise ShapeMismatch(f"{top_name(key)} has shape {shape}; this base model needs {expected}")


def check_base_copy(module: str, stored: torch.Tensor, base_weights: BaseWeights) -> None:
    """PEFT's saved copy of the base weight must be the base model's own (compared in the less
    precise of the two dtypes, as either may have been rounded from the other)."""
    ours = base_weights.top_weight(module).detach().to("cpu")
    dtype = min((stored.dtype, ours.dtype), key=lambda d: torch.finfo(d).bits)
    if not torch.equal(stored.to(dtype), ours.to(dtype)):
        raise BaseWeightsDiffer(
            f"the adapter's saved {module} base weight differs from this base model's: it was "
            "made for another model, or changed its vocabulary"
        )


def top_floats(settings: LoraSettings, base: BaseModelSpec) -> int:
    """The float32 values the adapter's embedding and lm_head weights take once converted."""
    vocab, hidden = base.vocab, base.hidden_size
    return (
        len(settings.top) * settings.rank * (vocab + hidden) + len(settings.saved) * vocab * hidden
    )


def fold_top(
    raw: dict[str, torch.Tensor],
    settings: LoraSettings,
    base_weights: BaseWeights | None,
    out: torch.Tensor | None,
) -> tuple[dict[str, LoraWeights], dict[str, torch.Tensor]]:
    """(LoRA pairs as float32 A and scaling * B, saved copies as float32) of the embedding and
    lm_head, written into `out` (flat, `top_floats` long) when given; PEFT's base copies are
    checked against `base_weights` when given, then dropped. Refuses NaN and infinity."""
    offset = 0

    def place(tensor: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        nonlocal offset
        if out is None:
            converted = tensor.to(torch.float32) * factor
        else:
            converted = out[offset : offset + tensor.numel()].view(tensor.shape)
            torch.mul(tensor.to(torch.float32), factor, out=converted)
        offset += tensor.numel()
        return converted

    top = {}
    for module in sorted(settings.top):
        a = place(raw[f"{module}.lora_A"])
        b = place(raw[f"{module}.lora_B"], settings.scaling)
        top[module] = LoraWeights(a=finite(a, f"{module}.lora_A"), b=finite(b, f"{module}.lora_B"))
        if base_weights is not None and f"{module}.base" in raw:
            check_base_copy(module, raw[f"{module}.base"], base_weights)
    saved = {m: finite(place(raw[f"{m}.saved"]), f"{m}.saved") for m in sorted(settings.saved)}
    return top, saved


def finite(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not bool(torch.isfinite(tensor).all()):
        raise NonFiniteWeights(f"{name} holds NaN or infinite values")
    return tensor
