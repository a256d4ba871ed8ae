"""Per-request state as the scheduler and runner see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loramux.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from loramux.engine.structured.grammar import GrammarMatcher


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
    computes its last position; the token is *pending* (counted in `len`, its value still on the
    device) until the step is postprocessed and it lands in `token_ids`. Only the last token can
    be pending when a step is prepared, and only from the step before (asynchronous scheduling).
    """

    request_id: str
    token_ids: list[int]
    """Prompt, then every sampled token that has landed."""
    params: SamplingParams
    adapter_id: str = BASE_ADAPTER
    cache_salt: str | None = None
    """Prefix-cache namespace (see `EngineRequest.cache_salt`)."""
    owner: str = ""
    """Its request's owner (`EngineRequest.owner`, "" for none): the scheduler queues new
    requests round-robin by owner (`Scheduler.add`)."""
    stop_token_ids: frozenset[int] = frozenset()
    """Sampling one of these ends the request (EOS unless `ignore_eos`, and `stop_token_ids`)."""
    grammar: GrammarMatcher | None = None
    """Where its structured output's grammar stands (`SamplingParams.structured`); it has
    consumed exactly the landed completion tokens, so recomputing after preemption leaves it.
    Each choice of a request has its own, made at admission: choices fork at the end of the
    prompt, before any completion token, so each starts from the grammar's start state."""
    num_prompt_tokens: int = field(init=False)
    num_pending_tokens: int = 0
    """Tokens sampled by scheduled steps that have not landed yet."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when it was admitted before producing any
    token (usage reports them)."""
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot_wait_steps: int = 0
    """Steps this request has waited at the head for an adapter slot (see Scheduler)."""
    arrival_time: float = field(default_factory=time.time)
    """Wall-clock seconds (time.time()) when it was added; the timings below are too."""
    scheduled_time: float | None = None
    """When a step first computed it (its admission, or the fork of a choice): its queue time
    ends here. None: never computed (what the scheduler's fair order and queue_share count)."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    index: int = 0
    """Which choice of its request this sequence generates (`SamplingParams.n`)."""
    forks: list[Sequence] = field(default_factory=list)
    """The request's other choices, waiting to fork from this one (choice 0) when the step that
    computes the end of its prompt is scheduled: they share its prompt's KV blocks and sample
    their first tokens from the same logits. Empty once forked (and for n = 1)."""

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        """Tokens once every scheduled step has landed: the KV positions are [0, len)."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_completion_tokens(self) -> int:
        """Sampled tokens that have landed."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
