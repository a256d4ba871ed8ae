"""The adapter error hierarchy: every refusal of an uploaded adapter is one `AdapterError`.

Each subclass names one kind of refusal with a stable machine-readable `code` (part of the
API: the gateway puts it in the OpenAI error body's `code`) and carries a message a person
can act on. All of them mean "the input is bad, nothing was stored"; the gateway maps them
to HTTP statuses in one place (400, or 413 for `file_too_large`).
"""

from __future__ import annotations

from typing import ClassVar


class AdapterError(Exception):
    """An adapter (or its upload) was refused. `code` is stable; the message is for people."""

    code: ClassVar[str] = "invalid_adapter"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MissingAdapterConfig(AdapterError):
    """The folder has no adapter_config.json."""

    code = "missing_config"


class InvalidAdapterConfig(AdapterError):
    """adapter_config.json is not a JSON object or a field has the wrong type or value."""

    code = "invalid_config"


class NotLoraAdapter(AdapterError):
    """`peft_type` is something other than LORA (IA3, prefix tuning, …)."""

    code = "not_lora"


class DoraUnsupported(AdapterError):
    """A DoRA adapter where DoRA cannot be served: on the embedding or the lm_head, or in an
    engine without the base weights its scales are computed from."""

    code = "dora_unsupported"


class ModulesToSaveUnsupported(AdapterError):
    """`modules_to_save` names a module other than the token embedding and the lm_head."""

    code = "modules_to_save_unsupported"


class AddedTokensUnsupported(AdapterError):
    """The adapter's embedding or lm_head has another vocabulary size than the base model's: it
    adds (or drops) tokens, which the tokenizer side does not support yet."""

    code = "added_tokens_unsupported"


class BaseWeightsDiffer(AdapterError):
    """A copy of a base-model weight saved with the adapter (PEFT saves the embedding and the
    lm_head it adapts) differs from the base model's: the adapter was made for another model."""

    code = "base_weights_differ"


class UnknownTargetModule(AdapterError):
    """A target names no q/k/v/o/gate/up/down projection of the base model."""

    code = "unknown_target_module"


class TargetPatternUnsupported(AdapterError):
    """`target_modules` (or `exclude_modules`) is a regular-expression string."""

    code = "target_pattern_unsupported"


class UnsupportedOption(AdapterError):
    """A PEFT option that changes the math and is not implemented (rank_pattern, alpha_pattern, …)."""

    code = "unsupported_option"


class BiasUnsupported(AdapterError):
    """`bias` other than "none", or `lora_bias: true`: adapters may not add or train biases."""

    code = "bias_unsupported"


class RankOverLimit(AdapterError):
    """`r` exceeds the configured maximum rank."""

    code = "rank_over_limit"


class PickledWeights(AdapterError):
    """The folder holds pickled weights (.bin, .pt, …); only safetensors are read."""

    code = "pickled_weights"


class MissingWeights(AdapterError):
    """The folder has no adapter_model.safetensors."""

    code = "missing_weights"


class InvalidWeightsFile(AdapterError):
    """adapter_model.safetensors cannot be parsed as a safetensors file."""

    code = "invalid_weights"


class UnsafeFile(AdapterError):
    """An adapter file is a symbolic link or not a regular file."""

    code = "unsafe_file"


class FileTooLarge(AdapterError):
    """A file (or an archive's content) is larger than the configured limit."""

    code = "file_too_large"


class UnsupportedDtype(AdapterError):
    """A weight is not float32, float16 or bfloat16."""

    code = "unsupported_dtype"


class ShapeMismatch(AdapterError):
    """A LoRA A/B shape does not match the base model's projection or the adapter's rank."""

    code = "shape_mismatch"


class UnexpectedTensors(AdapterError):
    """The weights hold tensors the config does not explain (other modules, biases, …)."""

    code = "unexpected_tensors"


class MissingTensors(AdapterError):
    """A targeted module lacks its lora_A or lora_B weight."""

    code = "missing_tensors"


class NonFiniteWeights(AdapterError):
    """A weight (or B after folding in the scaling) holds NaN or infinity."""

    code = "non_finite_weights"


class UnsafeArchive(AdapterError):
    """An uploaded archive holds links, absolute paths, `..`, or files other than the adapter's."""

    code = "unsafe_archive"


class InvalidArchive(AdapterError):
    """An uploaded archive is not a readable .zip or .tar.gz."""

    code = "invalid_archive"


class OverMemoryBudget(AdapterError):
    """The adapter's weights at their ranks need more than the engine's whole adapter memory."""

    code = "over_memory_budget"
