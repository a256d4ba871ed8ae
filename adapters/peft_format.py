"""Load a PEFT LoRA adapter folder into a validated, digested `LoraAdapter`.

Only two files are read: `adapter_config.json` (JSON) and `adapter_model.safetensors`
(safetensors: a JSON header plus raw bytes, so nothing is ever unpickled). Everything is
checked before a tensor is used: the config (see `peft_config`), file sizes, then the
safetensors header (names, dtypes, shapes) against the config and the base model, then the
values (finite). Any refusal raises an `AdapterError` subclass.

PEFT names each weight `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
(`base_model.model.layers…` when the adapter was made on the bare `LlamaModel`), and a DoRA
module's magnitude vector `…q_proj.lora_magnitude_vector`; inside loramux a weight is
`layers.{i}.{projection}.lora_{A|B}` or `layers.{i}.{projection}.lora_magnitude`. The token
embedding's and the lm_head's tensors are read by adapters.peft_top.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loramux.adapters.base_spec import PROJECTIONS, BaseModelSpec
from loramux.adapters.digest import adapter_digest
from loramux.adapters.dora import dora_scale
from loramux.adapters.errors import (
    FileTooLarge,
    InvalidAdapterConfig,
    InvalidWeightsFile,
    MissingAdapterConfig,
    MissingTensors,
    MissingWeights,
    NonFiniteWeights,
    PickledWeights,
    ShapeMismatch,
    UnexpectedTensors,
    UnsafeFile,
    UnsupportedDtype,
)
from loramux.adapters.peft_config import PARENT_MODULE, LoraSettings, parse_lora_config
from loramux.adapters.peft_top import (
    BaseWeights,
    check_top_shape,
    check_vocabulary,
    finite,
    fold_top,
    match_top_keys,
    top_floats,
    top_name,
)
from loramux.adapters.weights import LoraWeights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
"""Deepest nesting of lists and objects accepted in adapter_config.json (PEFT writes 3)."""
MAX_RANK_CEILING = 256
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_KEY = re.compile(  # a layer index of at most 6 digits: int() refuses one of over 4,300
    r"base_model\.model\.(?:model\.)?layers\.(0|[1-9][0-9]{0,5})\."
    r"(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_(A\.weight|B\.weight|magnitude_vector)"
)
_HALF = {"A.weight": "A", "B.weight": "B", "magnitude_vector": "M"}
"""A file key's last part → its tensor: the pair's A and B, and DoRA's magnitude (M)."""

ModuleKey = tuple[int, str]
"""(layer index, projection name)."""


@dataclass(frozen=True)
class AdapterLimits:
    """What an uploaded adapter may be at most; enforced before any weight is read."""

    max_rank: int = 64
    """Largest accepted `r` (at most 256): the engine's slots are sized for it."""
    max_file_bytes: int = 1 << 30
    """Largest accepted adapter_model.safetensors."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_rank <= MAX_RANK_CEILING:
            raise ValueError(f"max_rank must be within 1..{MAX_RANK_CEILING}, not {self.max_rank}")
        if self.max_file_bytes < 1:
            raise ValueError("max_file_bytes must be positive")


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A validated LoRA adapter for one base model. Treat it as immutable (tensors included);
    compare adapters by `digest`."""

    digest: str
    """Hex sha256 of the normalized config and the weights as stored (see adapters.digest)."""
    rank: int
    alpha: float
    use_rslora: bool
    scaling: float
    """alpha / r, or alpha / sqrt(r) with rsLoRA; already folded into every `b`."""
    modules: Mapping[ModuleKey, LoraWeights]
    use_dora: bool = False
    """DoRA: every module's output is rescaled by its `scale` (set when loaded with base weights)."""
    top: Mapping[str, LoraWeights] = field(default_factory=dict)
    """LoRA on "embed_tokens" (a [r, vocab], b [hidden, r]) and "lm_head" (a [r, hidden],
    b [vocab, r])."""
    saved: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """modules_to_save: the adapter's own [vocab, hidden] float32 "embed_tokens" or "lm_head"."""

    @property
    def targets(self) -> tuple[str, ...]:
        """The projections adapted in at least one layer, in canonical order."""
        adapted = {proj for _, proj in self.modules}
        return tuple(proj for proj in PROJECTIONS if proj in adapted)

    @property
    def nbytes(self) -> int:
        """Host memory held by the weights."""
        return sum(t.nbytes for t in self.flat_tensors())

    def flat_tensors(self) -> list[torch.Tensor]:
        """Every weight in memory order: the modules' (A, B, scale), the embedding's and
        lm_head's pairs, then the saved copies."""
        pairs = [*self.modules.values(), *(self.top[m] for m in sorted(self.top))]
        return [t for w in pairs for t in w.tensors()] + [self.saved[m] for m in sorted(self.saved)]

    def refuse_unrepresentable(self, dtype: torch.dtype) -> None:
        """NonFiniteWeights when a weight, finite in float32, is beyond what `dtype` (the
        engine's) holds: float16 holds at most 65504. Served, it would not hurt this adapter's
        requests alone: a batch's per-token kernels multiply one adapter's matrices with a
        block of tokens, other adapters' rows zeroed, and 0 x inf is NaN in those rows."""
        limit = torch.finfo(dtype).max
        if limit >= torch.finfo(torch.float32).max:
            return
        for tensor in self.flat_tensors():  # the largest magnitude, without a copy
            if tensor.numel() and float(torch.linalg.vector_norm(tensor, ord=math.inf)) > limit:
                raise NonFiniteWeights(
                    f"the adapter holds weights beyond {limit:g}, which the engine's {dtype} "
                    "cannot hold (after folding in the scaling and, for DoRA, the scales)"
                )


Storage = Callable[[int], torch.Tensor]
"""Where converted weights go: given a number of floats, a flat float32 tensor at least that
long (e.g. a pinned host buffer from a pool); the adapter's A and B matrices are views into it."""


def load_peft_adapter(
    folder: Path,
    base: BaseModelSpec,
    limits: AdapterLimits | None = None,
    storage: Storage | None = None,
    base_weights: BaseWeights | None = None,
) -> LoraAdapter:
    """Read, validate and convert the PEFT adapter in `folder` for the base model `base`; the
    weights are written into `storage`'s tensor (taken only once the header is validated) or
    into fresh tensors. A DoRA adapter's scales are computed from `base_weights` when given."""
    limits = limits or AdapterLimits()
    config_path, weights_path = adapter_files(Path(folder), limits)
    settings = parse_lora_config(_read_config(config_path), base, limits.max_rank)
    raw = _read_weights(weights_path, settings, base)
    digest = adapter_digest(settings.canonical(), raw)
    scaled = settings.use_dora and base_weights is not None
    sizes = {}
    for module in settings.modules:
        in_features, out_features = base.projection_shape(module[1])
        sizes[module] = settings.rank * (in_features + out_features) + scaled * out_features
    layers_floats = sum(sizes.values())
    flat = storage(layers_floats + top_floats(settings, base)) if storage is not None else None
    modules: dict[ModuleKey, LoraWeights] = {}
    offset = 0
    for module in sorted(settings.modules):
        out = flat[offset : offset + sizes[module]] if flat is not None else None
        weights = _fold(raw, module, settings.scaling, settings.rank, out)
        if settings.use_dora:
            magnitude = finite(raw[weight_name(module, "M")], weight_name(module, "M"))
            if base_weights is not None:
                weight = base_weights.projection_weight(*module)
                weights = _with_dora_scale(module, weights, magnitude, weight, out)
        modules[module] = weights
        offset += sizes[module]
    top_out = flat[layers_floats:] if flat is not None else None
    top, saved = fold_top(raw, settings, base_weights, top_out)
    return LoraAdapter(
        digest=digest,
        rank=settings.rank,
        alpha=settings.alpha,
        use_rslora=settings.use_rslora,
        scaling=settings.scaling,
        modules=modules,
        use_dora=settings.use_dora,
        top=top,
        saved=saved,
    )


def weight_name(module: ModuleKey, half: str) -> str:
    """loramux's name of a LoRA weight, e.g. `layers.3.q.lora_A` (`half` A, B or M)."""
    layer, proj = module
    return f"layers.{layer}.{proj}.lora_{'magnitude' if half == 'M' else half}"


def adapter_files(folder: Path, limits: AdapterLimits) -> tuple[Path, Path]:
    """The config and weights files of an adapter folder, after refusing pickles (anywhere in
    the folder), missing files, links and files over the limits. Reads no content."""
    if not folder.is_dir():
        raise MissingAdapterConfig(f"{folder.name} is not an adapter folder")
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise PickledWeights(
            f"pickled weights ({', '.join(pickles)}) are refused; save with safetensors "
            "(PEFT's save_pretrained does by default)"
        )
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.exists() and not config_path.is_symlink():
        raise MissingAdapterConfig(f"the adapter has no {CONFIG_FILE}")
    if not weights_path.exists() and not weights_path.is_symlink():
        raise MissingWeights(f"the adapter has no {WEIGHTS_FILE}")
    for path, limit in ((config_path, MAX_CONFIG_BYTES), (weights_path, limits.max_file_bytes)):
        if path.is_symlink() or not path.is_file():
            raise UnsafeFile(f"{path.name} must be a regular file, not a link or a folder")
        size = path.stat().st_size
        if size > limit:
            raise FileTooLarge(f"{path.name} is {size} bytes, over the limit of {limit}")
    return config_path, weights_path


def _read_config(path: Path) -> object:
    """The decoded config, refused when it is not JSON or nested past MAX_CONFIG_DEPTH: deeper
    values would overflow the recursion of the parser or of `repr` in an error message."""
    too_deep = InvalidAdapterConfig(
        f"{CONFIG_FILE} is nested more than {MAX_CONFIG_DEPTH} levels deep"
    )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidAdapterConfig(f"{CONFIG_FILE} is not valid JSON: {error}") from None
    except ValueError:
        # An integer literal longer than Python converts (sys.get_int_max_str_digits()).
        raise InvalidAdapterConfig(f"{CONFIG_FILE} holds a number too long to read") from None
    except RecursionError:
        raise too_deep from None
    if nesting_depth(config, MAX_CONFIG_DEPTH) > MAX_CONFIG_DEPTH:
        raise too_deep
    return config


def nesting_depth(value: object, limit: int) -> int:
    """How deep lists and objects nest in `value` (a scalar is 0), counted without recursion
    and only up to `limit + 1`."""
    deepest, pending = 0, [(value, 1)]
    while pending and deepest <= limit:
        item, depth = pending.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in item)
    return deepest


def _read_weights(
    path: Path, settings: LoraSettings, base: BaseModelSpec
) -> dict[str, torch.Tensor]:
    """Every LoRA weight by loramux name, as stored, after checking the header and values."""
    try:
        with safe_open(str(path), framework="pt") as file:
            names = sorted(file.keys())
            top_shapes = {
                k: list(file.get_slice(k).get_shape())
                for k in names
                if ".embed_tokens." in k or ".lm_head." in k
            }
            check_vocabulary(top_shapes, base)
            top_keys, rest = match_top_keys(names, settings)
            halves = "ABM" if settings.use_dora else "AB"
            keys = _match_keys(rest, settings.modules, halves)
            for (module, half), key in keys.items():
                tensor_slice = file.get_slice(key)
                _check_dtype(weight_name(module, half), tensor_slice.get_dtype())
                _check_shape(module, half, list(tensor_slice.get_shape()), settings.rank, base)
            for top_key, key in top_keys.items():
                tensor_slice = file.get_slice(key)
                _check_dtype(top_name(top_key), tensor_slice.get_dtype())
                check_top_shape(top_key, list(tensor_slice.get_shape()), settings.rank, base)
            weights = {weight_name(*weight): file.get_tensor(key) for weight, key in keys.items()}
            weights |= {top_name(k): file.get_tensor(key) for k, key in top_keys.items()}
    except SafetensorError as error:
        raise InvalidWeightsFile(
            f"{WEIGHTS_FILE} is not a valid safetensors file: {error}"
        ) from None
    return weights


def _match_keys(
    keys: list[str], modules: frozenset[ModuleKey], halves: str
) -> dict[tuple[ModuleKey, str], str]:
    """Map (module, half) to file keys: one of each of `halves` ("AB", or "ABM" for DoRA) per
    targeted module, nothing else."""
    found: dict[tuple[ModuleKey, str], str] = {}
    unexpected: list[str] = []
    for key in sorted(keys):
        match = _KEY.fullmatch(key)
        if match is None or match[2] != PARENT_MODULE[match[3]]:
            unexpected.append(key)
            continue
        module, half = (int(match[1]), match[3]), _HALF[match[4]]
        if module not in modules or half not in halves or (module, half) in found:
            unexpected.append(key)
            continue
        found[module, half] = key
    if unexpected:
        raise UnexpectedTensors(
            f"{len(unexpected)} tensor(s) the config does not explain, e.g. {unexpected[:3]}"
        )
    missing = [
        weight_name(m, half) for m in sorted(modules) for half in halves if (m, half) not in found
    ]
    if missing:
        raise MissingTensors(f"{len(missing)} targeted weight(s) are missing, e.g. {missing[:3]}")
    return found


def _check_dtype(name: str, dtype: str) -> None:
    if dtype not in _DTYPES:
        raise UnsupportedDtype(f"{name} is {dtype}; weights must be F32, F16 or BF16")


def _check_shape(
    module: ModuleKey, half: str, shape: list[int], rank: int, base: BaseModelSpec
) -> None:
    """lora_A is [r, in_features], lora_B is [out_features, r], a magnitude [out_features]."""
    in_features, out_features = base.projection_shape(module[1])
    expected = {"A": [rank, in_features], "B": [out_features, rank], "M": [out_features]}[half]
    if shape != expected:
        raise ShapeMismatch(
            f"{weight_name(module, half)} has shape {shape}; "
            f"rank {rank} on this base model needs {expected}"
        )


def _fold(
    raw: dict[str, torch.Tensor],
    module: ModuleKey,
    scaling: float,
    rank: int,
    out: torch.Tensor | None,
) -> LoraWeights:
    """float32 A and scaling * B (written into `out`, flat, when given), refusing NaN or
    infinity (also from an overflowing fold)."""
    stored_a, stored_b = raw[weight_name(module, "A")], raw[weight_name(module, "B")]
    if out is None:
        a = stored_a.to(torch.float32).contiguous()
        b = (stored_b.to(torch.float32) * scaling).contiguous()
    else:
        a = out[: stored_a.numel()].view(stored_a.shape).copy_(stored_a)
        b = out[stored_a.numel() : stored_a.numel() + stored_b.numel()].view(stored_b.shape)
        torch.mul(stored_b.to(torch.float32), scaling, out=b)
    assert a.shape[0] == rank == b.shape[1], "the header check let a wrong rank through"
    return LoraWeights(a=finite(a, weight_name(module, "A")), b=finite(b, weight_name(module, "B")))


def _with_dora_scale(
    module: ModuleKey,
    weights: LoraWeights,
    magnitude: torch.Tensor,
    base_weight: torch.Tensor,
    out: torch.Tensor | None,
) -> LoraWeights:
    """`weights` with DoRA's scale (written into `out` after A and B, when given), refusing a
    scale that is NaN or infinite (a row of the merged weight of norm zero)."""
    scale = dora_scale(base_weight, weights.a, weights.b, magnitude)
    if not bool(torch.isfinite(scale).all()):
        raise NonFiniteWeights(
            f"{weight_name(module, 'M')} gives an infinite DoRA scale: a row of the adapted "
            "weight has norm zero"
        )
    if out is not None:
        scale = out[weights.a.numel() + weights.b.numel() :].copy_(scale)
    return LoraWeights(a=weights.a, b=weights.b, scale=scale)
