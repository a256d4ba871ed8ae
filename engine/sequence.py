"""Per-request state as the scheduler and runner see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    """The engine could not compute this request (see `RequestOutput.error`); others go on."""


BASE_ADAPTER = "base"
"""Adapter identity of requests served by the base model alone (prefix-cache key part)."""


@dataclass(eq=False)
class Sequence:
    """One request's tokens and progress.

    Invariants: positions `[0, num_computed_tokens)` have their K/V in the blocks of
    `block_table`, or are being computed by a step the scheduler has handed out;
    `num_computed_tokens <= len(self)`. A sequence samples a token in a step only when that step
    computes its last position; the token lands in `token_ids` when the step is postprocessed.
    """

    request_id: str
    token_ids: list[int]
    """Prompt, then every sampled token that has landed."""
    params: SamplingParams
    adapter_id: str = BASE_ADAPTER
    cache_salt: str | None = None
    """Prefix-cache namespace (see `EngineRequest.cache_salt`)."""
    stop_token_ids: frozenset[int] = frozenset()
    """Sampling one of these ends the request (EOS unless `ignore_eos`, and `stop_token_ids`)."""
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when it was admitted before producing any
    token (usage reports them)."""
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot_wait_steps: int = 0
    """Steps this request has waited at the head for an adapter slot (see Scheduler)."""

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
