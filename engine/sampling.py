"""Sampling parameters of one request, validated when constructed.

Every number a request gives is checked against what the sampler's arithmetic supports, so no
request can make a step divide by zero, overflow to infinity or hand NaN to the random draw:
non-finite values are refused, a temperature too small to divide by is greedy, and a seed of any
size is folded into the 64 bits the sampler reads.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from loramux.engine.errors import InvalidRequestError, number_text
from loramux.engine.structured import StructuredOutput

MIN_TEMPERATURE = 1e-5
"""Temperatures below this are greedy. At 1e-5 a logit gap of 0.001 already becomes 100, so
sampling there is greedy but for exact ties; smaller temperatures only add ways to fail:
logits divided by 1e-38 overflow to infinity, and 5e-324 is 0 in float32."""

MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)."""
MAX_LOGIT_BIAS = 100.0
"""A logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)."""
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16
"""The most choices (`n`) one request may ask the engine for; gateways may cap lower."""

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
    """In [-2, 2]. OpenAI's definition: logit[t] -= presence_penalty when t occurs among the
    tokens this choice generated so far (the prompt does not count)."""
    frequency_penalty: float = 0.0
    """In [-2, 2]. OpenAI's definition: logit[t] -= frequency_penalty * (times t occurs among
    the tokens this choice generated so far)."""
    repetition_penalty: float = 1.0
    """A finite number > 0; 1 is off. transformers' RepetitionPenaltyLogitsProcessor: for every
    token t in the prompt or generated so far, logit[t] is divided by it when positive and
    multiplied by it when negative."""
    min_p: float = 0.0
    """In [0, 1]; 0 is off. transformers' MinPLogitsWarper: after temperature, drop the tokens
    whose probability is below min_p times the most likely token's. No effect when greedy."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, at most 300, each bias in [-100, 100], added to those tokens'
    logits; each id at most once. Ids must be in [0, vocab): the engine checks them when the
    request is admitted."""
    logprobs: bool = False
    """Return each generated token's logprob (`RequestOutput.logprobs`, see `TokenLogprob` for
    which distribution they are of)."""
    top_logprobs: int = 0
    """0..20: also return this many most likely tokens at each position; needs `logprobs`."""
    n: int = 1
    """Choices to generate, 1..16. The prompt is computed once and its KV shared by the choices.
    Choice i of a seeded request draws from `choice_seed(seed, i)` (choice 0 from the seed
    itself), so choices differ yet are reproducible."""
    structured: StructuredOutput | None = None
    """Constrain the output to JSON (see `StructuredOutput`); None leaves it free. Not with
    `ignore_eos`: a constrained output ends when its value is complete."""

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
        self._check_processors()
        _require_bool("logprobs", self.logprobs)
        _require_int("top_logprobs", self.top_logprobs)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                f"got {number_text(self.top_logprobs)}"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs")
        _require_int("n", self.n)
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}], got {number_text(self.n)}")

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_finite(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {number_text(value)}")
        _require_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {number_text(self.repetition_penalty)}"
            )
        _require_finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {number_text(self.min_p)}")
        if not isinstance(self.logit_bias, tuple | list):
            raise InvalidRequestError("logit_bias must be a list of (token id, bias) pairs")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries"
            )
        seen: set[int] = set()
        for entry in self.logit_bias:
            if not isinstance(entry, tuple | list) or len(entry) != 2:
                raise InvalidRequestError("logit_bias must be a list of (token id, bias) pairs")
            token_id, bias = entry
            _require_int("logit_bias", token_id)
            _require_finite("logit_bias", bias)
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    "logit_bias needs token ids >= 0 and biases in [-100, 100], got "
                    f"{number_text(token_id)}: {number_text(bias)}"
                )
            if token_id in seen:  # one token's biases would add up past the bound
                raise InvalidRequestError(
                    f"logit_bias holds token id {number_text(token_id)} more than once"
                )
            seen.add(token_id)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalizes(self) -> bool:
        """Some penalty changes this request's logits from the tokens so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def seed_bits(self) -> int | None:
        """The seed in the sampler's range [0, 2^64); None when the request gave no seed."""
        return None if self.seed is None else self.seed % SEED_RANGE


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` of a request draws from: the request's own for choice 0 (so n=1
    and choice 0 of n agree), a 64-bit hash of (seed mod 2^64, index) for the others."""
    if seed is None or index == 0:
        return seed
    h = hashlib.blake2b(digest_size=8, person=b"loramux-choice")
    h.update((seed % SEED_RANGE).to_bytes(8, "little") + index.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false")


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
