"""Sampling parameters of one request, validated when constructed.

Every number a request gives is checked against what the sampler's arithmetic supports, so no
request can make a step divide by zero, overflow to infinity or hand NaN to the random draw:
non-finite values are refused, a temperature too small to divide by is greedy, and a seed of any
size is folded into the 64 bits the sampler reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError, number_text
from engine.structured import StructuredOutput

MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy. At 1e-5 a logit gap of 0.001 already becomes 100, so
sampling there is greedy but for exact ties; smaller temperatures only add ways to fail:
logits divided by 1e-38 overflow to infinity, and 5e-324 is 0 in float32."""

SEED_RANGE = 2**64
"""The sampler's seeded draws read 64 bits of seed (`engine.sampler.seeded_exponential`); every
integer seed is taken mod this."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    """Most tokens to generate; at least 1."""
    temperature: float = 0.0
    """A finite number >= 0. Below MIN_TEMPERATURE (1e-5), 0 included, decoding is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, a finite number in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Any integer (negative, or past 64 bits, too). Same seed, same sampled output, whatever
    else shares the batch. The sampler draws from `seed mod 2^64` (Python's `%`, so the result
    is never negative): seeds that differ by a multiple of 2^64, like -1 and 2^64 - 1, draw the
    same tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings: output ends before the first occurrence, which is not included. Matched on
    text by whoever detokenizes (the gateway, which then aborts the engine's sequence); the
    engine itself only sees token ids."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the output (the model's EOS ids always do)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it to fix output lengths)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    structured: StructuredOutput | None = None
    """Constrain the output to JSON (see `StructuredOutput`); None leaves it free. Not with
    `ignore_eos`: a constrained output ends when its value is complete."""
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _require_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {number_text(self.max_tokens)}"
            )
        _require_finite("temperature", self.temperature)
        if self.temperature < 0.0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {number_text(self.temperature)}"
            )
        _require_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {number_text(self.top_p)}")
        _require_int("top_k", self.top_k)
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {number_text(self.top_k)}")
        if self.seed is not None:
            _require_int("seed", self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise InvalidRequestError("structured must be a StructuredOutput")
            if self.ignore_eos:
                raise InvalidRequestError("ignore_eos cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def seed_bits(self) -> int | None:
        """The seed in the sampler's range [0, 2^64); None when the request gave no seed."""
        return None if self.seed is None else self.seed % SEED_RANGE


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer")


def _require_finite(name: str, value: object) -> None:
    """A real number (not a bool) that converts to a finite float: no NaN, no infinity, no
    integer past float's range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number")
    try:
        finite = math.isfinite(float(value))
    except OverflowError:
        finite = False
    if not finite:
        raise InvalidRequestError(f"{name} must be a finite number, got {number_text(value)}")
