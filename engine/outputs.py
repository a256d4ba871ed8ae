"""What the engine hands back: requests in, deltas and usage out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loramux.engine.errors import RequestFailedError
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import FinishReason

MAX_CACHE_SALT_CHARS = 1024
"""A salt names a namespace (a tenant id, a hash): longer ones are refused, not hashed."""


@dataclass(frozen=True)
class EngineRequest:
    """One generation request. Exactly one of `prompt`, `prompt_token_ids` or `messages` is set."""

    request_id: str
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    """Raw text; control-token text in it (`<|im_start|>`, …) is tokenized as plain text."""
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat messages, rendered with the model's chat template and a generation prompt; control-token
    text in the messages' strings is tokenized as plain text (engine.chat_prompt)."""
    tools: list[dict[str, Any]] | None = None
    """Tools offered with `messages` (OpenAI tool objects as plain data), rendered by the chat
    template as its `tools`."""
    adapter: str | None = None
    """Adapter digest (content identity) to serve this request with; None for the base model."""
    cache_salt: str | None = None
    """Prefix-cache isolation key, e.g. the tenant's id: KV blocks computed under one salt are
    never reused under another (nor under None), so `Usage.cached_tokens` only ever counts reuse
    under the caller's own salt and no tenant can learn from timing what another one sent.
    None shares blocks with every other request without a salt (and the same adapter). At most
    MAX_CACHE_SALT_CHARS characters."""
    owner: str | None = None
    """Who sent it (the gateway names the tenant's id): a full engine queue is shared between
    owners (engine.queue_share), so one owner cannot lock the others out. Unlike `cache_salt`,
    which tenants in a shared prefix-cache scope share, it names one tenant. None: requests
    without an owner share one. At most MAX_CACHE_SALT_CHARS characters."""


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
class RequestTimings:
    """When the engine handled one request, in wall-clock seconds (time.time()), reported with
    its final output: metrics take durations from them and the gateway's trace makes the
    engine's spans (queue, prefill, decode) from them after the fact. None: never reached."""

    arrived: float
    scheduled: float | None
    """The first step that computed it: the queue ends and prefill starts."""
    first_token: float | None
    """Its first token landed: prefill ends and decode starts."""
    finished: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the most likely tokens at its position.

    The values are the log-softmax of the logits the token was sampled from after the logits
    processors (repetition, presence and frequency penalties, logit bias) and before temperature,
    top-k, top-p and min-p, as OpenAI and vLLM report them: the same whatever the temperature,
    and for a request without processors the log-softmax of the model's own logits. For a
    structured output they are taken after the grammar's mask, the distribution the token was
    drawn from: the token's own logprob and its alternatives' are then of one distribution, and
    a token the grammar forbids (logprob -inf, no number OpenAI's schema admits) is never an
    alternative."""

    logprob: float
    top: list[tuple[int, float]]
    """The `top_logprobs` most likely (token id, logprob) pairs at this position, best first;
    fewer when the grammar allowed fewer tokens there."""


@dataclass(frozen=True)
class RequestOutput:
    """One streamed delta: the token ids generated since the last one; the last delta carries
    `finish_reason` and `usage`. Token ids only: whoever serves text (the gateway) detokenizes
    and matches stop strings (`SamplingParams.stop` is not applied by the engine).

    A request the engine cannot compute ends with `finish_reason` ERROR and `error` saying why:
    its logits were not finite (NaN or infinity, e.g. from an adapter whose weights overflow),
    or computing its step raised. Only that request ends so; the rest of its batch goes on, its
    KV blocks and adapter pin are freed, and the engine keeps serving. `LLMEngine.step()` returns
    such an output; the async facade (and so the engine service) raises it instead, as
    `error_type` on that request's stream, so callers never see ERROR as a finish reason.

    With `n` > 1 each choice streams its own deltas (`index`) and ends with its own
    `finish_reason`; `usage` (prompt and cached tokens once, completion tokens summed over the
    choices) rides only on the request's last output, the one that ends its last choice
    (`is_last`). A choice that fails fails the whole request: its ERROR output is the last.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    """Why the request failed; set only when `finish_reason` is ERROR."""
    error_type: type[RequestFailedError] = field(default=RequestFailedError, kw_only=True)
    """What a failed request raises on its stream: `AdapterUnavailableError` when its adapter
    could not be loaded (not the request's computation, nor a fault of the engine's);
    `StructuredOutputFailedError` when its grammar failed mid-generation (its own schema's
    doing)."""
    index: int = 0
    """The choice (0..n-1) these tokens belong to."""
    logprobs: list[TokenLogprob] | None = None
    """With `SamplingParams.logprobs`: one entry per token of `token_ids`, aligned."""
    timings: RequestTimings | None = field(default=None, compare=False)
    """Set on the request's last output only. Not part of an output's equality: two runs of
    the same request are equal outputs at different times."""

    @property
    def finished(self) -> bool:
        """This choice has ended."""
        return self.finish_reason is not None

    @property
    def is_last(self) -> bool:
        """The request's last output: every choice has ended (it carries the usage)."""
        return self.usage is not None


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
    aborted: int
    """Requests aborted (a client left, a stop string matched at the gateway, an abort call)."""
    steps: int
    prefix_cache_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache since start (hits / queries = hit rate)."""
