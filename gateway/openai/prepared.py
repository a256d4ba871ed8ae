"""What `CompletionService.prepare` decides about a request before anything is sent."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from loramux.cache.types import CacheHit, CachePolicy, CacheRequest, Fence
from loramux.engine.outputs import EngineRequest
from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.catalog import ResolvedModel
from loramux.gateway.openai.generation import Generation
from loramux.gateway.openai.models import system_fingerprint
from loramux.gateway.openai.responses import Answer, ResponseMeta
from loramux.gateway.openai.tool_use import ToolUse
from loramux.gateway.quotas import Admission
from loramux.gateway.served_identity import ServedIdentity


@dataclass(frozen=True)
class ServingLimits:
    """What the served model and the server's settings allow."""

    base_model: str
    max_model_len: int
    vocab_size: int
    default_max_tokens: int
    """max_tokens of a request that gives none (at most what the context has room for)."""
    identity: ServedIdentity
    """The base model's files and dtype, and the engine's code, as digests (engine.identity)."""

    @property
    def served_base(self) -> str:
        """The base model as the response cache and system_fingerprint know it: its name and
        its identity, so that new weights under the same name never share the old ones'
        answers or fingerprint. Not the engine's build: another build's answers are served,
        under the fingerprint they were made with (`CachedResponse.fingerprint`)."""
        return f"{self.base_model}@{self.identity.model_identity}"

    def fingerprint(self, adapter_digest: str | None) -> str:
        """The `system_fingerprint` of answers of this base model with adapter `adapter_digest`
        (None: the base model alone)."""
        return system_fingerprint(self.identity.build, self.served_base, adapter_digest)


@dataclass(frozen=True)
class Draft:
    """A request before its prompt is tokenized: the prompt as text or messages, and sampling
    parameters whose max_tokens is 1 when the request gave none (`max_tokens_given`); it is
    derived from the prompt's length once tokenized."""

    text_request: EngineRequest
    max_tokens_given: bool
    schema_param: str = "response_format"
    """The field whose schema constrains the output: `tools` for a forced tool call."""

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt: `messages`, or a completion's `prompt`."""
        return "prompt" if self.text_request.messages is None else "messages"


@dataclass(frozen=True)
class Tokenized:
    """A request with its prompt as text or messages (`text_request`: what the cache keys on),
    and that prompt's token ids."""

    text_request: EngineRequest
    prompt_ids: list[int]

    @property
    def engine_request(self) -> EngineRequest:
        """What crosses to the engine: token ids, and no stop strings (matched on the text, at
        the gateway)."""
        r = self.text_request
        return EngineRequest(
            r.request_id,
            replace(r.params, stop=()),
            prompt_token_ids=self.prompt_ids,
            adapter=r.adapter,
            cache_salt=r.cache_salt,
            owner=r.owner,
        )


@dataclass(frozen=True)
class CacheLookup:
    key: CacheRequest
    policy: CachePolicy
    hit: CacheHit | None
    fence: Fence | None = None
    """What a store of the answer is checked against (`cache.types.Fence`)."""

    @property
    def outcome(self) -> str:
        if self.hit is not None:
            return self.hit.kind
        return "miss" if self.policy.lookup else "bypass"


@dataclass(kw_only=True)
class Prepared:
    request: EngineRequest
    """What the engine gets: the prompt as token ids, sampling without stop strings."""
    stop: tuple[str, ...]
    """Stop strings, matched on the text as the gateway detokenizes."""
    meta: ResponseMeta
    model: ResolvedModel
    principal: Principal
    prompt_tokens: int
    stream: bool
    admission: Admission
    cache: CacheLookup
    tools: ToolUse
    started: float
    """When the request reached the gateway (time.perf_counter)."""
    run: Generation | None = None
    """The engine request, once started (`CompletionService.start`)."""
    answers: list[Answer] = field(default_factory=list)
    """Each choice whole, once the run has ended."""
    ended: bool = False
    """A cache hit's end has been metered and its reservation settled (by whichever ended
    first: its replay, or its response)."""

    def headers(self) -> dict[str, str]:
        headers = dict(self.admission.headers)
        headers["x-cache"] = self.cache.outcome
        hit = self.cache.hit
        if hit is not None and hit.similarity is not None:
            headers["x-cache-similarity"] = f"{hit.similarity:.4f}"
        return headers
