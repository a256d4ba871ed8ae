"""From a `StructuredOutput` to a grammar over the engine's tokenizer, and the per-sequence
matcher that follows a request's tokens. The library is llguidance (docs/architecture.md,
"Structured outputs", says why).

Compiling is bounded, so no request can hang or crash the engine with its schema:
- the text is at most `MAX_SCHEMA_CHARS` characters and `MAX_SCHEMA_DEPTH` levels of JSON
  nesting, checked by one linear scan before anything parses it (a 1,000-level schema is
  refused before Python's or the library's recursion meets it);
- it must parse as a JSON object;
- llguidance's parser limits (`LIMITS`) cap the lexer's and parser's work while building the
  grammar and while computing each token's mask (its "fuel"), and the grammar's size; past them
  compiling fails with an error, or a matcher enters its error state and that request fails.

Compiling runs on the caller's thread at admission (`LLEngine.validate`; the async facade runs
it off the event loop), never on the step thread for a request whose grammar was just validated:
results are cached by schema text, and the step thread only copies the cached matcher.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf

from loramux.engine.structured import StructuredOutput, StructuredOutputError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the type stubs only

MAX_SCHEMA_DEPTH = 64
"""Deepest JSON nesting of a schema's text (objects and arrays). OpenAI's strict mode allows 10
levels of schema nesting, each a few levels of JSON."""

CACHE_ENTRIES = 256
"""Compiled grammars kept, least recently used dropped first."""

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
"""Compact JSON: no whitespace between tokens, so a model cannot pad its output forever."""

LIMITS = llguidance.LLParserLimits(verbose_errors=False)
"""llguidance's default limits (building a grammar's lexer: ~20 ms of fuel; one token's mask:
~15 ms of lexer fuel and ~2.5 ms of parser items; 500,000 grammar symbols), with error messages
that do not echo parser state."""


class CompiledGrammar:
    """A grammar ready to match: an LLMatcher in its start state that is only ever copied."""

    def __init__(self, template: llguidance.LLMatcher):
        self._template = template

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class GrammarMatcher:
    """One sequence's position in its grammar.

    Invariant: it has consumed exactly the sequence's landed completion tokens, in order. It is
    advanced once per landed token (`accept`), never for pending or recomputed ones, so
    preemption (which recomputes KV of tokens already landed) leaves it as it is.
    """

    def __init__(self, matcher: llguidance.LLMatcher):
        self.ll = matcher

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar did not allow it or the matcher failed
        earlier (ran past its limits), which ends the request."""
        return self.ll.consume_token(token)

    @property
    def error(self) -> str:
        """Why the matcher failed; empty while it has not."""
        return self.ll.get_error()

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (for a choice that forks a sequence)."""
        return GrammarMatcher(self.ll.deep_copy())


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer; safe from any thread.

    `tokenizer` is the engine's Hugging Face fast tokenizer; `vocab_size` the model's logit width
    (ids past the tokenizer's are never allowed); `eos_ids` the tokens allowed once a value is
    complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids)
        )
        self._cache: OrderedDict[tuple[str, str | None], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The grammar of `spec`, from the cache or compiled now; StructuredOutputError says why
        it cannot be."""
        key = spec.cache_key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        compiled = CompiledGrammar(self._matcher(_grammar_text(spec)))
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer, limits=LIMITS)
        if error:
            raise StructuredOutputError(f"the JSON schema cannot be compiled: {error}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=LIMITS)
        # Some grammars fail only when first asked for a mask (a $ref that refers only to
        # itself): ask once here, on a copy, so they are refused at admission.
        probe = matcher.deep_copy()
        first = probe.compute_bitmask()
        error = matcher.get_error() or probe.get_error()
        if error:
            raise StructuredOutputError(f"the JSON schema cannot be compiled: {error}")
        if not any(first):
            raise StructuredOutputError("the JSON schema allows no output at all")
        return matcher


def _grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec`, after the bounds in the module docstring."""
    if spec.json_schema is None:
        schema: dict[str, Any] = {"type": "object"}
    else:
        schema = _schema_object(spec.json_schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(f"the JSON schema cannot be compiled: {exc}") from None


def _schema_object(text: str) -> dict[str, Any]:
    depth = json_depth(text)
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(
            f"the JSON schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted"
        )
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(
            f"the JSON schema must be a JSON object, got {type(schema).__name__}"
        )
    return schema


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON `text`, brackets inside strings not
    counted; one pass, no recursion, whatever the text is."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def check_structured_output(spec: StructuredOutput) -> None:
    """Refuse, with StructuredOutputError, what can be refused without a tokenizer: a schema
    out of bounds, not JSON, or one the library cannot compile. The gateway calls it before it
    queues anything, so a streamed request gets its 400 before the stream starts; the engine
    compiles (and probes the first mask) again at admission. Verdicts are remembered by schema
    text, so a schema that many requests share is checked once per process."""
    error = _check_error(spec)
    if error is not None:
        raise StructuredOutputError(error)


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _check_error(spec: StructuredOutput) -> str | None:
    try:
        grammar = _grammar_text(spec)
    except StructuredOutputError as exc:
        return str(exc)
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=LIMITS)
    return f"the JSON schema cannot be compiled: {error}" if error else None
