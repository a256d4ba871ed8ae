"""What the response cache is asked, how it may answer, and what it answers with.

A `CacheRequest` holds everything that can change an answer; two requests share an exact entry
only when every field is equal. The gateway builds it (`gateway.cache_policy.cache_request`)
after the model is resolved, so `adapter` is the adapter's content digest (or "base"): a
re-uploaded adapter has a new digest and never meets the old version's entries.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from loramux.cache.pacing import Pacing

MAX_TTL = 7 * 86400
"""The longest an entry may live (seconds); also how long a purge's epoch is remembered."""

INCARNATION_ID = "id"
"""The field of the incarnation hash (`Keyspace.incarnation`) that holds the server's id."""

RequestKind = Literal["chat", "text"]
HitKind = Literal["exact", "semantic"]
VerifierName = Literal["strict", "off"]


@dataclass(frozen=True)
class CacheRequest:
    """Everything that identifies an answer.

    `base_model` names the served base model and its identity (a digest of its files: see
    engine.identity), so an entry made by other weights under the same name never matches.
    `messages` are (role, content) pairs after normalization (roles system/user/assistant, text
    content); None for text completions, which carry `prompt` (a string or token ids) instead.
    `params` are every output-changing parameter as sorted (name, value) pairs with JSON-able
    values (max_tokens, temperature, top_p, top_k, seed, stop, response_format, …).
    """

    tenant_id: str
    base_model: str
    adapter: str
    kind: RequestKind
    messages: tuple[tuple[str, str], ...] | None
    prompt: str | tuple[int, ...] | None
    params: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class CachePolicy:
    """What this request may do with the cache.

    `lookup`: read (exact, then semantic when `semantic`); `store`: write the response after it
    is generated. `threshold` is the cosine similarity a semantic candidate needs before the
    verifier (`strict`: see `cache.verifier`; `off`: similarity alone) decides. `ttl` is the
    entry's lifetime in seconds. `pacing` says how a streamed hit is sent (`cache.pacing`).
    """

    lookup: bool
    store: bool
    semantic: bool
    ttl: int
    threshold: float
    verifier: VerifierName
    pacing: Pacing = field(default_factory=Pacing)


@dataclass(frozen=True)
class CachedResponse:
    """A finished completion as the cache keeps it (one choice). `logprobs` and `tool_calls` are
    the choice's as the API wrote them (JSON values), so a hit replays them exactly."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: Any = None
    tool_calls: Any = None
    fingerprint: str = ""
    """The `system_fingerprint` its answer was made under (engine build, weights, adapter),
    which a hit replays: an answer another engine build made keeps that build's. '' where the
    writer names none."""


@dataclass(frozen=True)
class CacheHit:
    """A lookup's answer; `similarity` is the cosine similarity of a semantic hit, else None."""

    response: CachedResponse
    kind: HitKind
    similarity: float | None


@dataclass(frozen=True)
class Fence:
    """What a write of a request's answer (its entry, its request record, its semantic-index
    entry) is checked against, atomically, in the script that writes it (`cache.scripts.FENCE`):
    the purge epochs of the request's tenant scope and adapter scope, as read when its lookup
    ran, before the engine made the answer. A purge moves its scope's epoch before it deletes,
    so an answer made before a purge (or a hit read before it) is never written after it; a
    deleted tenant's epoch is a tombstone that refuses every write.

    The epochs prove nothing once the cache Redis has lost them: it keeps no data across a
    restart, and it may evict any key (`allkeys-lru`); an epoch never set reads '' as before
    the purge. So the epochs are fields of the one hash that also holds the server's
    incarnation id (`Keyspace.incarnation`), read in the same round trip, lost together, and a
    write is refused when the server is another incarnation than its lookup read, or when its
    lookup read none (the first write script on a server without one sets one).

    `key` is that hash, `fields` the two epochs' fields in it; `seen` their values and the
    incarnation id then ('' for none), or None for a write that read none (then only a
    tombstone the server holds refuses it): one whose lookup failed (Redis down or restarting)
    stores when Redis is back, as a cache that resumes by itself should. It knows no
    incarnation to compare, and needs none for a purge before the failure: its answer was made
    after that purge. A purge after its failed lookup and before its store, and a deleted
    tenant whose tombstone a restart or an eviction lost (as every request of that tenant a
    gateway still admits would), are not seen."""

    key: str
    fields: tuple[str, str]
    seen: tuple[str, str, str] | None = None

    @property
    def keys(self) -> tuple[str]:
        """The Redis keys the write scripts take for it: the incarnation hash."""
        return (self.key,)

    @property
    def read(self) -> list[str]:
        """The hash's fields a lookup reads (HMGET), in `seen` order: the two epochs, the id."""
        return [*self.fields, INCARNATION_ID]

    def args(self) -> list[str]:
        """The scripts' six arguments: the epochs' fields, the values seen ('*' each for any),
        then a fresh id that becomes the server's incarnation if it has none."""
        seen = list(self.seen) if self.seen is not None else ["*", "*", "*"]
        return [*self.fields, *seen, secrets.token_hex(8)]


@dataclass(frozen=True)
class Consulted:
    """What a request's lookup found (None: a miss, or no lookup) and the fence a store of its
    answer carries (None when it may not store)."""

    hit: CacheHit | None
    fence: Fence | None


def encode_response(response: CachedResponse) -> bytes:
    return json.dumps(
        {
            "text": response.text,
            "finish_reason": response.finish_reason,
            "prompt_tokens": response.prompt_tokens,
            "completion_tokens": response.completion_tokens,
            "logprobs": response.logprobs,
            "tool_calls": response.tool_calls,
            "fingerprint": response.fingerprint,
        },
        ensure_ascii=False,
    ).encode()


def decode_response(raw: bytes | str) -> CachedResponse:
    data = json.loads(raw)
    return CachedResponse(
        data["text"],
        data["finish_reason"],
        data["prompt_tokens"],
        data["completion_tokens"],
        data.get("logprobs"),
        data.get("tool_calls"),
        data.get("fingerprint", ""),
    )
