"""What the engine hands back: requests in, deltas and usage out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.sampling import SamplingParams
from engine.sequence import FinishReason


@dataclass(frozen=True)
class EngineRequest:
    """One generation request. Exactly one of `prompt`, `prompt_token_ids` or `messages` is set."""

    request_id: str
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat messages, rendered with the model's chat template and a generation prompt."""
    adapter: str | None = None
    """Adapter digest (content identity) to serve this request with; None for the base model."""
    cache_salt: str | None = None
    """Prefix-cache namespace: KV blocks are reused only between requests with the same salt
    (the gateway gives each tenant its own); None is the namespace of unsalted requests."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache instead of being computed."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestOutput:
    """One streamed delta. Deltas' `text` concatenate to the final text; the last one carries
    `finish_reason` and `usage`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_hit_tokens: int
    """Prompt tokens served from the prefix cache since start."""
    prompt_tokens_computed: int
    """Prompt (prefill) tokens actually run through the model since start."""
    generated_tokens: int
    preemptions: int
    steps: int
