"""Which engine serves a request: adapter/prefix affinity first, the least loaded as fallback.

Affinity is rendezvous hashing: every engine scores `hash(url, key)` and the highest score is
preferred. The key is the adapter digest (so an adapter stays resident on one engine) or, for
base-model requests, the first characters of the prompt (so shared prefixes meet the prefix cache
that holds them). Adding or losing an engine moves only the keys that engine scored highest.
The preferred engine is passed over when it is marked down or much busier than the least loaded.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

from loramux.engine.outputs import EngineRequest

PREFIX_CHARS = 64
"""Characters (or token ids) of a base request's prompt that pick its engine."""
DOWN_SECONDS = 2.0
"""How long an engine that failed is passed over before it is tried again."""
BUSY_FACTOR, BUSY_SLACK = 2, 4
"""The preferred engine is much busier when its load exceeds FACTOR × least load + SLACK."""


@dataclass
class Endpoint:
    """One engine service as the router sees it. `load` is running + waiting from its last
    /stats; `adapters` the digests it is known to serve (a cache, corrected on refusal)."""

    url: str
    load: int = 0
    down_until: float = 0.0
    adapters: set[str] = field(default_factory=set)
    max_adapter_bytes: int | None = None
    """The largest adapter it takes (config and weights, uploaded in parts), once learned."""
    judged: bool = False
    """Admitted or refused on its current connection (gateway.engine_client.admission)."""
    refused: str | None = None
    """Why this client refused it (it serves another model), until a connection is admitted:
    a refused engine is never routed to."""

    def is_down(self, now: float) -> bool:
        return now < self.down_until

    def mark_down(self) -> None:
        self.down_until = time.monotonic() + DOWN_SECONDS
        self.adapters.clear()  # it may come back as a fresh process, of another model
        self.max_adapter_bytes = None
        self.judged = False


def adapter_key(digest: str) -> str:
    return f"adapter:{digest}"


def affinity_key(request: EngineRequest) -> str:
    """Requests with equal keys prefer the same engine."""
    if request.adapter is not None:
        return adapter_key(request.adapter)
    if request.prompt is not None:
        return f"text:{request.prompt[:PREFIX_CHARS]}"
    if request.prompt_token_ids is not None:
        return f"ids:{request.prompt_token_ids[:PREFIX_CHARS]}"
    return f"chat:{json.dumps(request.messages, sort_keys=True)[:PREFIX_CHARS]}"


def _score(url: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{url}\n{key}".encode(), digest_size=8).digest())


def route(endpoints: list[Endpoint], key: str) -> list[Endpoint]:
    """Every endpoint not refused in the order to try them: the preferred one (or the least
    loaded when the preferred is much busier), the other live ones by load, then those marked
    down."""
    now = time.monotonic()
    usable = [e for e in endpoints if e.refused is None]
    live = [e for e in usable if not e.is_down(now)]
    down = sorted((e for e in usable if e.is_down(now)), key=lambda e: e.down_until)
    if not live:
        return down
    preferred = max(live, key=lambda e: _score(e.url, key))
    rest = sorted((e for e in live if e is not preferred), key=lambda e: e.load)
    if rest and preferred.load > BUSY_FACTOR * rest[0].load + BUSY_SLACK:
        return [rest[0], preferred, *rest[1:], *down]
    return [preferred, *rest, *down]
