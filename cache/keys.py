"""Where entries live in Redis, and which requests may share them.

Every key starts with `<prefix>:<T>:<A>:` where T and A are short hashes of the tenant id and
the adapter digest, so a tenant's (or one adapter's) entries are one SCAN pattern away and no
tenant id can spell a pattern that matches another tenant's keys.

- exact entry: `<prefix>:<T>:<A>:x:<sha256 of every CacheRequest field>`, a string holding the
  response, with the entry's TTL;
- request record: `<prefix>:<T>:r:<hash of the request id>`, the key of the entry that request
  was served from or stored, for as long as that entry lives (so an admin can report it);
- semantic bucket: `<prefix>:<T>:<A>:s:{<bucket>}:<part>`, where the bucket hashes every field
  except the last user message — tenant, base model, adapter, parameters, the system prompt and
  every earlier turn — so the same question after a different conversation lands elsewhere.
  The `{…}` hash tag keeps a bucket's keys together;
- incarnation: `<prefix>:incarnation`, a hash that never expires: `id`, a random id the first
  cache to run on a server sets (its start, or the first write script on a server that lost
  it: restarted without persistence, flushed, or the hash evicted), and the purge epochs,
  fields `purged:<T>` and `purged:<T>:<A>`: a random id each purge of that scope sets (a
  `gone:` tombstone for a deleted tenant), with its expiry (the longest entry lifetime; each
  purge drops the expired ones). Every write of an entry, a request record or a
  semantic-index entry checks them in its script, and a lookup reads them with the id
  (`cache.types.Fence`): a write whose lookup read another id (or none) is refused. Epochs and
  id live in one key so that the cache Redis's eviction (`allkeys-lru`) or a restart loses
  them together: an epoch lost alone would read as never purged. Outside the scopes they
  guard, a purge's SCAN never meets it.

The scripts take keys of several hash slots (an entry, its record, the incarnation): one Redis
server, not a Cluster.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from loramux.cache.types import CacheRequest, Fence

KEY_VERSION = 5
"""Bumped when the key derivation or an entry's format changes, so old entries are never
misread (2: schemas and tools keep their key order; 3: so do the arguments of a history's tool
calls; 4: an entry keeps the `system_fingerprint` it was made under; 5: an entry's chat logprobs
leave out the tokens its content does not show, the end of turn)."""


def glob_escape(text: str) -> str:
    """`text` as a Redis MATCH pattern that matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


SEMANTIC_MAX_CHARS = 1000
"""Longer last messages are documents, not questions: they are cached exactly only."""


def _digest(*parts: Any) -> str:
    """sha256 of `parts` as JSON. Objects keep their key order: where a request's JSON holds a
    schema, its property order changes the output (`gateway.cache_policy._canonical`)."""
    blob = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _short(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def exact_hash(req: CacheRequest) -> str:
    """sha256 over every field; a str prompt and a token-id prompt never collide (JSON types)."""
    return _digest(
        KEY_VERSION,
        req.tenant_id,
        req.base_model,
        req.adapter,
        req.kind,
        req.messages,
        req.prompt,
        req.params,
    )


def semantic_question(req: CacheRequest) -> str | None:
    """The text the semantic cache embeds: the last message when it is the user's, else None.

    Runs of whitespace become one space and trailing sentence punctuation goes ("What is X?"
    and "what is x" embed alike), except inside quotes and backticks (`question_text`). Text
    completions are never semantic (a paraphrased prompt asks for another continuation), nor
    are empty or very long last messages, nor messages `exact_only` refuses (laid out as code,
    an unclosed quote, `!5` or `(2+3)!`).
    """
    if req.kind != "chat" or not req.messages:
        return None
    role, content = req.messages[-1]
    if role != "user" or exact_only(content):
        return None
    text = question_text(content)
    if not text or len(text) > SEMANTIC_MAX_CHARS:
        return None
    return text


_LAYOUT = re.compile(r"```|~~~|\n[ \t]+\S|\t")
"""A code fence, an indented line, a tab: whitespace there may carry meaning (Python's blocks:
`print` inside or after a loop), and no normalization can tell."""

LITERAL = re.compile(
    # 'a b', 'don't stop' (not the apostrophes of "it's" or "students'"); a newline may be
    # inside: the span is found on the raw message, before whitespace is collapsed
    r"(?<!\w)'(?:[^']|(?<=[^\W_])'(?=[^\W_]))*'(?!\w)"
    r'|"[^"]*"|`[^`]*`|“[^”]*”'
    r"|‘(?:[^’]|(?<=[^\W_])’(?=[^\W_]))*’"  # ‘It’s OK’: a ’ between letters is an apostrophe
)
"""A quoted or backticked span: its characters are the question (`'a  b'` has another length
than `'a b'`, `'Hello'` other letters than `'hello'`), kept verbatim and compared exactly. An
apostrophe between two letters does not close a single-quoted span."""

_UNCLOSED = re.compile(r'["`“‘]')
"""Quote marks that only open or close a span: one left outside every `LITERAL` span is a quote
left open (or an inch mark), and what it quotes cannot be told."""

_UNREAD_FACTORIAL = re.compile(r"(?<![\w!])!\d|\)!")
"""A factorial the verifier cannot read: the subfactorial `!5` (44, read as 5), and one of a
bracketed expression, `(2+3)!` (read as 2+3)."""


def layout_bound(content: str) -> bool:
    """Whether a message's meaning may depend on its layout (`_LAYOUT`): such a message is cached
    exactly only, never semantically."""
    return _LAYOUT.search(content) is not None


def exact_only(content: str) -> bool:
    """Whether a message is cached exactly only, never semantically: laid out as code
    (`layout_bound`), a quote mark left open (`_UNCLOSED`), a factorial it cannot read (`_UNREAD_FACTORIAL`), or
    quoted spans that normalizing would change (each span is found once, on the raw message;
    `question_text` must keep them all, verbatim, and find no other)."""
    if layout_bound(content) or _UNREAD_FACTORIAL.search(content):
        return True
    spans = [m.group() for m in LITERAL.finditer(content)]
    if _UNCLOSED.search(LITERAL.sub("", content)):
        return True
    return [m.group() for m in LITERAL.finditer(question_text(content))] != spans


def question_text(content: str) -> str:
    """A user message as the semantic cache embeds and verifies it (see `semantic_question`):
    whitespace runs collapsed and trailing "?.! " dropped outside quoted spans (`LITERAL`),
    which stay verbatim, and a "!" after a digit kept (the factorial "5!" is not "5")."""
    parts, last = [], 0
    for match in LITERAL.finditer(content):
        parts += [re.sub(r"\s+", " ", content[last : match.start()]), match.group()]
        last = match.end()
    parts.append(re.sub(r"\s+", " ", content[last:]))
    text = "".join(parts).strip()
    end = len(text)
    while end and text[end - 1] in "?.! ":
        bangs = end
        while bangs and text[bangs - 1] == "!":
            bangs -= 1
        if bangs < end and bangs and text[bangs - 1].isdigit():
            break  # a factorial, not an exclamation
        end -= 1
    return text[:end]


def bucket_hash(req: CacheRequest, embedder_id: str) -> str:
    """Everything but the last user message, and the embedder (vectors of another model are not
    comparable)."""
    history = req.messages[:-1] if req.messages else ()
    return _digest(
        KEY_VERSION,
        embedder_id,
        req.tenant_id,
        req.base_model,
        req.adapter,
        req.kind,
        history,
        req.params,
    )[:32]


@dataclass(frozen=True)
class BucketKeys:
    """The Redis keys of one semantic bucket, in the order the Lua scripts take them."""

    info: str
    """hash: epoch (random id of this incarnation), head (log entries trimmed), next (slots used)"""
    vectors: str
    """string: one fixed-size record per slot (see `cache.vectors`)"""
    meta: str
    """hash: slot -> JSON {k: response key, q: question, x: expiry ms}; a slot is live iff here"""
    lru: str
    """sorted set: slot -> last use (ms)"""
    expiry: str
    """sorted set: slot -> expiry (ms)"""
    free: str
    """list: slots freed by eviction or expiry, reused first"""
    log: str
    """list: slots changed, in order; processes replay it to keep their in-memory copy current"""
    by_response: str
    """hash: response key -> slot, so storing the same entry twice refreshes one slot"""
    vset: str
    """vector set (Redis 8): the bucket's entries when the server searches them itself
    (`cache.vset_index`); unused by the core index"""

    def all(self) -> list[str]:
        return [
            self.info,
            self.vectors,
            self.meta,
            self.lru,
            self.expiry,
            self.free,
            self.log,
            self.by_response,
        ]


class Keyspace:
    """Key names under one prefix."""

    def __init__(self, prefix: str = "lmx:rc"):
        self.prefix = prefix

    def scope(self, tenant_id: str, adapter: str | None = None) -> str:
        """The key prefix of a tenant's entries, or of one adapter's entries of that tenant."""
        base = f"{self.prefix}:{_short(tenant_id)}:"
        return base if adapter is None else f"{base}{_short(adapter)}:"

    def epoch(self, tenant_id: str, adapter: str | None = None) -> str:
        """The purge epoch's field (in `incarnation`) of a tenant's scope, or of one adapter's
        scope of that tenant."""
        base = f"purged:{_short(tenant_id)}"
        return base if adapter is None else f"{base}:{_short(adapter)}"

    @property
    def incarnation(self) -> str:
        """The key of the hash of the server's incarnation id and the purge epochs (see the
        module docstring)."""
        return f"{self.prefix}:incarnation"

    def fence(self, req: CacheRequest) -> Fence:
        """What a write of `req`'s answer checks, not yet read: its tenant's and its adapter's
        purge epochs, and the server's incarnation."""
        epochs = self.epoch(req.tenant_id), self.epoch(req.tenant_id, req.adapter)
        return Fence(self.incarnation, epochs)

    def request(self, tenant_id: str, request_id: str) -> str:
        """Which entry answered a request (`…:r:<hash of the request id>`): found only under the
        tenant that made the request."""
        return f"{self.scope(tenant_id)}r:{_short(request_id)}{_short(request_id[::-1])}"

    def exact(self, req: CacheRequest) -> str:
        return f"{self.scope(req.tenant_id, req.adapter)}x:{exact_hash(req)}"

    def bucket(self, req: CacheRequest, embedder_id: str) -> BucketKeys:
        base = f"{self.scope(req.tenant_id, req.adapter)}s:{{{bucket_hash(req, embedder_id)}}}"
        return BucketKeys(
            *(f"{base}:{part}" for part in ("i", "v", "m", "u", "e", "f", "l", "k", "vs"))
        )

    @staticmethod
    def is_exact(key: str) -> bool:
        """Whether a key (of this keyspace) is an exact entry: `…:x:<hash>`."""
        return key.rsplit(":", 2)[-2] == "x"
