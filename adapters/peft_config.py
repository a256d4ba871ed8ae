"""Parse and validate a PEFT `adapter_config.json` against the base model.

The result, `LoraSettings`, is everything in the config that changes the math: the rank,
the scaling, whether it is DoRA, the exact set of (layer, projection) modules the adapter
adapts, and whether it adapts (LoRA) or replaces (`modules_to_save`) the token embedding and the
lm_head, resolved the way PEFT resolves `target_modules` / `exclude_modules` /
`layers_to_transform` against the module names of a Hugging Face `LlamaForCausalLM`.

Policy for the many other PEFT fields: a known option the engine cannot honour is refused
with its own error; fields that only matter at training time are ignored; any other field
(a PEFT release newer than this code) is refused when it is set to something other than
its "off" value (null, false, empty), so a new LoRA variant is never served as plain LoRA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loramux.adapters.base_spec import PROJECTIONS, BaseModelSpec
from loramux.adapters.errors import (
    BiasUnsupported,
    DoraUnsupported,
    InvalidAdapterConfig,
    ModulesToSaveUnsupported,
    NotLoraAdapter,
    RankOverLimit,
    TargetPatternUnsupported,
    UnknownTargetModule,
    UnsupportedOption,
)

PARENT_MODULE = {
    "q": "self_attn",
    "k": "self_attn",
    "v": "self_attn",
    "o": "self_attn",
    "gate": "mlp",
    "up": "mlp",
    "down": "mlp",
}
"""The Llama submodule holding each projection; its PEFT name is `<projection>_proj`."""

TOP_MODULES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
"""The modules outside the layers an adapter may adapt or save, by loramux name: PEFT's name."""

# Fields read only while training or creating the adapter, or metadata: no effect on inference.
# The *_config fields only configure their own `init_lora_weights` mode (PEFT drops or ignores
# them otherwise); those that change the base weights are refused with their mode.
_IGNORED_FIELDS = frozenset(
    {
        "auto_mapping", "base_model_name_or_path", "corda_config", "ensure_weight_tying",
        "eva_config", "fan_in_fan_out", "inference_mode", "loftq_config", "lora_dropout",
        "lora_ga_config", "megatron_core", "peft_version", "qalora_group_size", "revision",
        "task_type",
    }
)  # fmt: skip
_HANDLED_FIELDS = frozenset(
    {
        "peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules",
        "layers_to_transform", "layers_pattern", "bias", "lora_bias", "use_dora",
        "modules_to_save", "rank_pattern", "alpha_pattern", "init_lora_weights",
    }
)  # fmt: skip
# `init_lora_weights` modes that only set A and B's first values, which the saved weights then
# replace: the adapter is plain LoRA on the unchanged base (true, false and null likewise). They
# stay out of the digest: they do not change what the adapter computes. The other modes (pissa,
# pissa_niter_<n>, olora, corda, loftq, lora_ga) start from base weights they change,
# W - scaling * B0 @ A0, which a base model shared by every adapter cannot be.
_BASE_KEEPING_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica"})
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_MAX_TARGET_ENTRIES = 4096
_ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSettings:
    """The math of a LoRA adapter: delta_W[m] = scaling * B[m] @ A[m] for m in modules; with
    DoRA, each module's output is then rescaled per output channel (see adapters.dora)."""

    rank: int
    alpha: float
    use_rslora: bool
    modules: frozenset[tuple[int, str]]
    """(layer index, projection) pairs that carry a LoRA pair."""
    use_dora: bool = False
    """Every module also carries a magnitude vector (PEFT's `use_dora`)."""
    top: frozenset[str] = frozenset()
    """Of TOP_MODULES, those that carry a LoRA pair (never DoRA)."""
    saved: frozenset[str] = frozenset()
    """Of TOP_MODULES, those the adapter replaces by its own full copy (`modules_to_save`).
    Together with `modules` and `top`, never empty, and disjoint from `top`."""

    @property
    def scaling(self) -> float:
        """alpha / sqrt(r) with rsLoRA, alpha / r otherwise (PEFT's definition)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def canonical(self) -> dict[str, Any]:
        """The normalized config that enters the digest: only fields that change the math."""
        canonical: dict[str, Any] = {
            "format": "peft-lora",
            "r": self.rank,
            "lora_alpha": float(self.alpha),
            "use_rslora": self.use_rslora,
            "modules": sorted(f"{layer}.{proj}" for layer, proj in self.modules),
        }
        # Only when set: adapters without them keep the digests they always had.
        if self.use_dora:
            canonical["use_dora"] = True
        if self.top:
            canonical["top_modules"] = sorted(self.top)
        if self.saved:
            canonical["modules_to_save"] = sorted(self.saved)
        return canonical


def parse_lora_config(config: Any, base: BaseModelSpec, max_rank: int) -> LoraSettings:
    """Validate a decoded adapter_config.json; raise the matching AdapterError on refusal."""
    if not isinstance(config, dict):
        raise InvalidAdapterConfig("adapter_config.json must hold a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise NotLoraAdapter(f"peft_type is {_brief(peft_type)}; only LORA adapters are accepted")
    _refuse_unsupported_features(config)
    rank = _required_int(config, "r")
    if rank < 1:
        raise InvalidAdapterConfig(f"r must be at least 1, not {rank}")
    if rank > max_rank:
        raise RankOverLimit(f"rank {rank} is over this server's limit of {max_rank}")
    alpha = _finite_number(config, "lora_alpha")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise InvalidAdapterConfig(f"use_rslora must be true or false, not {_brief(use_rslora)}")
    use_dora = config.get("use_dora") or False
    if not isinstance(use_dora, bool):
        raise InvalidAdapterConfig(f"use_dora must be true or false, not {_brief(use_dora)}")
    modules, targeted_top = _resolve_modules(config, base)
    saved, shielded = _modules_to_save(config, base)
    top = targeted_top - shielded  # as PEFT: no LoRA on a module modules_to_save names
    if targeted_top and not (modules or top):
        raise InvalidAdapterConfig("every module target_modules selects is in modules_to_save")
    if top & saved:
        raise InvalidAdapterConfig(
            f"{', '.join(sorted(top & saved))} is both a LoRA target and saved whole: "
            "modules_to_save names it by part of its name, so PEFT does not leave it out of "
            "the targets (and cannot load the adapter); name it whole"
        )
    if use_dora and top:
        raise DoraUnsupported(
            f"DoRA on {', '.join(sorted(top))} is not supported; only on the projections"
        )
    if not (modules or top or saved):
        raise InvalidAdapterConfig("target_modules selects no module of the base model")
    if (top or saved) and config.get("ensure_weight_tying"):
        # PEFT would then tie the adapter's embedding and lm_head copies on a tied base model.
        raise UnsupportedOption("ensure_weight_tying with embed_tokens or lm_head is not supported")
    return LoraSettings(
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        modules=modules,
        use_dora=use_dora,
        top=top,
        saved=saved,
    )


def _refuse_unsupported_features(config: dict[str, Any]) -> None:
    """Refuse every option that would make the adapter more than LoRA or DoRA on linear layers
    (and the embedding and lm_head)."""
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise BiasUnsupported(
            f"adapters may not train biases (bias={_brief(config.get('bias'))}, "
            f"lora_bias={_brief(config.get('lora_bias'))}); use bias: none"
        )
    for name in ("rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise UnsupportedOption(f"{name} (per-module rank or alpha) is not supported")
    _refuse_base_changing_init(config.get("init_lora_weights"))
    for name, value in config.items():
        if name in _IGNORED_FIELDS or name in _HANDLED_FIELDS or value in (None, False, "", [], {}):
            continue
        raise UnsupportedOption(f"the PEFT option {_brief(name)}={_brief(value)} is not supported")


def _refuse_base_changing_init(init: Any) -> None:
    """Refuse an `init_lora_weights` mode after which the adapter is more than plain LoRA on
    the base model's weights as they are (PEFT re-runs it when it loads the adapter)."""
    if init is None or isinstance(init, bool):
        return
    if isinstance(init, str) and init.lower() in _BASE_KEEPING_INITS:
        return
    if not isinstance(init, str) or not init.lower().startswith(_BASE_CHANGING_INITS):
        raise UnsupportedOption(f"init_lora_weights={_brief(init)} is not a PEFT initialisation")
    raise UnsupportedOption(
        f"init_lora_weights={_brief(init)} is not supported: this initialisation changes the "
        "base weights the adapter is trained on (W - scaling * B0 @ A0), and every adapter "
        "shares one base model; PEFT's save_pretrained(path_initial_model_for_weight_conversion"
        "=...) converts a PiSSA, OLoRA, CorDA or LoRA-GA adapter to plain LoRA"
    )


def _brief(value: Any) -> str:
    """A user-supplied value for an error message, cut short: messages stay readable."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _required_int(config: dict[str, Any], name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidAdapterConfig(f"{name} must be an integer, not {_brief(value)}")
    return value


def _finite_number(config: dict[str, Any], name: str) -> float:
    """The field as a float; an integer too large for one (JSON's are unbounded, `10**400`
    makes `float` and `math.isfinite` raise OverflowError) is refused like infinity."""
    value = config.get(name)
    refusal = InvalidAdapterConfig(f"{name} must be a finite number, not {_brief(value)}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise refusal
    try:
        number = float(value)
    except OverflowError:
        raise refusal from None
    if not math.isfinite(number):
        raise refusal
    return number


def _resolve_modules(
    config: dict[str, Any], base: BaseModelSpec
) -> tuple[frozenset[tuple[int, str]], frozenset[str]]:
    """Apply PEFT's module matching to the base model's module names: the (layer, projection)
    modules and the TOP_MODULES targeted.

    A list entry t matches module name n when n == t or n ends with "." + t (so "q_proj",
    "self_attn.q_proj" and "model.layers.3.self_attn.q_proj" all work); "all-linear" means
    every projection's full name, as PEFT expands it (it leaves out the lm_head). Entries
    matching nothing are refused. With `layers_to_transform`, only exact names select the
    embedding or the lm_head (they are in no layer), as in PEFT.
    """
    names = {
        f"model.layers.{layer}.{PARENT_MODULE[proj]}.{proj}_proj": (layer, proj)
        for layer in range(base.num_layers)
        for proj in PROJECTIONS
    }
    raw_targets = config.get("target_modules")
    if isinstance(raw_targets, str) and raw_targets.lower() == _ALL_LINEAR:
        raw_targets = list(names)
    targets = _target_list(raw_targets, "target_modules")
    if not targets:
        raise InvalidAdapterConfig("target_modules is required")
    excludes = _target_list(config.get("exclude_modules"), "exclude_modules")
    for target in targets:
        if not any(_matches(name, target) for name in [*names, *TOP_MODULES.values()]):
            raise UnknownTargetModule(
                f"target {_brief(target)} names no q/k/v/o/gate/up/down projection, embed_tokens "
                "or lm_head of the base model"
            )
    layers = _layers_to_transform(config)
    modules = frozenset(
        module
        for name, module in names.items()
        if not any(_matches(name, exclude) for exclude in excludes)
        and _is_targeted(name, module[0], targets, layers)
    )
    top = frozenset(
        short
        for short, name in TOP_MODULES.items()
        if not any(_matches(name, exclude) for exclude in excludes)
        and _is_targeted(name, None, targets, layers)
    )
    return modules, top


def _modules_to_save(
    config: dict[str, Any], base: BaseModelSpec
) -> tuple[frozenset[str], frozenset[str]]:
    """The TOP_MODULES `modules_to_save` saves whole, and those it keeps LoRA off, as PEFT
    resolves it: it saves every module whose name ends with an entry (so "head" saves the
    lm_head), and puts no LoRA on a module an entry names whole or by a dotted suffix.

    An entry that also ends another module's name (a layer's norm, "s" of model.layers), or
    none of TOP_MODULES, is refused: only the embedding and the lm_head can be saved."""
    entries = _target_list(config.get("modules_to_save"), "modules_to_save")
    others = _other_module_names(base)
    saved: set[str] = set()
    shielded: set[str] = set()
    for entry in dict.fromkeys(entries):
        matched = [short for short, name in TOP_MODULES.items() if name.endswith(entry)]
        if not matched or any(name.endswith(entry) for name in others):
            raise ModulesToSaveUnsupported(
                f"modules_to_save names {_brief(entry)}; only embed_tokens and lm_head can be "
                "saved whole"
            )
        saved.update(matched)
        shielded.update(short for short in matched if _matches(TOP_MODULES[short], entry))
    return frozenset(saved), frozenset(shielded)


def _other_module_names(base: BaseModelSpec) -> list[str]:
    """The names of a Hugging Face `LlamaForCausalLM`'s modules other than TOP_MODULES."""
    names = ["model", "model.layers", "model.norm", "model.rotary_emb"]
    for layer in range(base.num_layers):
        prefix = f"model.layers.{layer}"
        names += [prefix, f"{prefix}.self_attn", f"{prefix}.mlp", f"{prefix}.mlp.act_fn"]
        names += [f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"]
        names += [f"{prefix}.{PARENT_MODULE[proj]}.{proj}_proj" for proj in PROJECTIONS]
    return names


def _target_list(value: Any, field: str) -> list[str]:
    """A list of module-name suffixes (empty when unset); a string is a regex: refused."""
    if value is None:
        return []
    if isinstance(value, str):
        raise TargetPatternUnsupported(
            f"{field} is the regular expression {_brief(value)}; list the module names instead"
        )
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise InvalidAdapterConfig(f"{field} must be a list of module names")
    if len(value) > _MAX_TARGET_ENTRIES:
        raise InvalidAdapterConfig(f"{field} has more than {_MAX_TARGET_ENTRIES} entries")
    return value


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _is_targeted(
    name: str, layer: int | None, targets: list[str], layers: frozenset[int] | None
) -> bool:
    """PEFT's rule: an exact name always counts; a suffix match only within layers_to_transform
    (never, when it is set, for a module in no layer: `layer` None)."""
    if name in targets:
        return True
    in_layers = layers is None or (layer is not None and layer in layers)
    return in_layers and any(name.endswith("." + target) for target in targets)


def _layers_to_transform(config: dict[str, Any]) -> frozenset[int] | None:
    """The layer indices a suffix match is restricted to, or None for every layer."""
    value = config.get("layers_to_transform")
    pattern = config.get("layers_pattern")
    if pattern not in (None, "", [], "layers", ["layers"]):
        raise UnsupportedOption(
            f"layers_pattern {_brief(pattern)} is not supported (only 'layers')"
        )
    if value is None or value == []:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset({value})
    if isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        return frozenset(value)
    raise InvalidAdapterConfig(
        f"layers_to_transform must be an integer or a list, not {_brief(value)}"
    )
