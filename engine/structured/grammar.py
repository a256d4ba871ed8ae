"""From a `StructuredOutput` to a grammar over the engine's tokenizer, and the per-sequence
matcher that follows a request's tokens. The library is llguidance (docs/architecture.md,
"Structured outputs", says why).

The schema's bounds and its grammar text are engine.structured.schema's. llguidance's parser
limits (`LIMITS`) cap the lexer's and parser's work while computing each token's mask (its
"fuel"): past them a matcher enters its error state and that request fails. The gateway checks
each schema first, in a child process bounded in time (gateway.schema_checks): what
reaches the engine compiled there in under a second without a tokenizer.

Text the grammar forces (a `const`, an `enum` of one value, a property name, a fixed `pattern`)
is outside the fuel: every mask inside a forced run tokenizes all the rest of the run again, so
a run of n bytes costs each of its tokens time in proportion to n (99,000 bytes: 0.2-0.4 s a
mask, every step, for every row of the request). A grammar may force at most `MAX_FORCED_BYTES`
in a row: one that forces more from its start is refused at admission, one that comes to force
more later (one branch of an `anyOf`) fails its request when the token that led there lands.

Compiling runs on the caller's thread at admission (`LLEngine.validate`; the async facade runs
it on threads of its own, owners in turn, and a grammar already compiled at once), never on the
step thread for a request whose grammar was just validated: results are cached by schema text,
and the step thread only copies the cached matcher.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import llguidance

from loramux.engine.chat_prompt import control_tokens
from loramux.engine.structured import StructuredOutput, StructuredOutputError
from loramux.engine.structured.schema import LIMITS, PANIC_ERROR, grammar_text, is_panic

log = logging.getLogger(__name__)

CACHE_ENTRIES = 256
"""Compiled grammars kept, least recently used dropped first."""

MAX_FORCED_BYTES = 4096
"""Most bytes of output a grammar may force in a row (the module docstring says why). Each mask
in a run this long takes the library about 2-7 ms on this project's 2-core machine, near its
fuel's per-token bound; OpenAI's strict mode caps all of a schema's names and enum values
together at 15,000 characters."""


class NotCompiled(LookupError):
    """A grammar asked for from the cache alone is not there (`GrammarCompiler.compiled`)."""


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
        self._panic = ""

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar did not allow it or the matcher failed
        (ran past its limits, or the library panicked), which ends the request alone.

        The matcher may have failed while computing the mask `token` was drawn from (a grammar
        with no way forward: llguidance's NoExtensionBias). Its mask then allows only EOS, and
        `consume_token` accepts that EOS, so its error state is checked as well: else a cut
        value would end as a complete one."""
        try:
            return self.ll.consume_token(token) and not self.ll.is_error()
        except BaseException as exc:
            if not is_panic(exc):
                raise
            self._panic = f"the grammar library failed: {exc}"
            return False

    @property
    def error(self) -> str:
        """Why the matcher failed; empty while it has not."""
        return self._panic or self.ll.get_error()

    def forcing_error(self) -> str:
        """Why the output cannot go on from here: the grammar now forces more than
        `MAX_FORCED_BYTES` bytes in a row, or the library failed computing them; empty when it
        can. Ask after each landed token that does not end the sequence."""
        try:
            return forced_text_error(self.ll)
        except BaseException as exc:
            if not is_panic(exc):
                raise
            return f"the grammar library failed: {exc}"


def forced_text_error(matcher: llguidance.LLMatcher) -> str:
    """Why `matcher`'s grammar cannot be served from its state: it forces more than
    `MAX_FORCED_BYTES` bytes of output in a row; empty when it does not, or when computing the
    run failed (the matcher's own error says why). The library computes the forced run once
    and keeps it (the masks that follow use it)."""
    forced = len(matcher.compute_ff_bytes())
    if forced <= MAX_FORCED_BYTES or matcher.is_error():
        return ""
    return (
        f"the JSON schema forces at least {forced:,} bytes of output in a row (a long const, "
        f"enum value, property name or fixed pattern); at most {MAX_FORCED_BYTES:,} are served"
    )


_Key = tuple[str | None, str, str | None]
"""A cached grammar's scope (its owner), then its spec's cache key."""


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer; safe from any thread.

    `tokenizer` is the engine's Hugging Face fast tokenizer; `vocab_size` the model's logit width
    (ids past the tokenizer's are never allowed); `eos_ids` the tokens allowed once a value is
    complete.
    """

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]
    ) -> GrammarCompiler | None:
        """The compiler, or None (and structured requests refused) when the grammar library
        cannot read the tokenizer."""
        try:
            return cls(tokenizer, vocab_size, eos_ids)
        except (ValueError, TypeError):
            log.warning("structured output is off: the tokenizer is not supported", exc_info=True)
            return None

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            _text_only_tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=sorted(eos_ids)
        )
        self._cache: OrderedDict[_Key, CompiledGrammar] = OrderedDict()
        self._compiling: dict[_Key, Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self.compiles = 0
        """Grammars compiled so far (each schema once while it stays cached)."""

    def compile(self, spec: StructuredOutput, scope: str | None = None) -> CompiledGrammar:
        """The grammar of `spec`, from the cache or compiled now; StructuredOutputError says why
        it cannot be. Callers asking for a schema being compiled wait for that compile and
        share its result (or its error): concurrent requests with one schema compile it once.

        The cache is kept per `scope` (the request's owner, a tenant): a grammar one owner
        compiled is compiled again for another, whose request would otherwise be checked at
        once, not after a compile, and so tell it which schemas others had just used."""
        key = (scope, *spec.cache_key)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
            underway = self._compiling.get(key)
            if underway is None:
                self._compiling[key] = mine = Future[CompiledGrammar]()
                self.compiles += 1
        if underway is not None:
            return underway.result()
        try:
            compiled = CompiledGrammar(self._matcher(grammar_text(spec)))
        except BaseException as exc:
            with self._lock:
                del self._compiling[key]
            mine.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[key]
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        mine.set_result(compiled)
        return compiled

    def cached(self, spec: StructuredOutput, scope: str | None = None) -> bool:
        """Whether `spec`'s grammar is in `scope`'s cache (`compile` would not compile it)."""
        with self._lock:
            return (scope, *spec.cache_key) in self._cache

    def compiled(self, spec: StructuredOutput, scope: str | None = None) -> CompiledGrammar:
        """`spec`'s grammar from `scope`'s cache, never compiling it: NotCompiled when it is
        not there (`compile` would take time)."""
        key = (scope, *spec.cache_key)
        with self._lock:
            found = self._cache.get(key)
            if found is None:
                raise NotCompiled(f"the {spec.kind} grammar is not compiled yet")
            self._cache.move_to_end(key)
            return found

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        try:
            return self._checked_matcher(grammar)
        except BaseException as exc:
            if not is_panic(exc):
                raise
            raise StructuredOutputError(PANIC_ERROR) from None

    def _checked_matcher(self, grammar: str) -> llguidance.LLMatcher:
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer, limits=LIMITS)
        if error:
            raise StructuredOutputError(f"the JSON schema cannot be compiled: {error}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=LIMITS)
        # Some grammars fail only when first asked for a mask (a $ref that refers only to
        # itself): ask once here, on a copy, so they are refused at admission. A long forced
        # run is refused before that mask would tokenize it.
        probe = matcher.deep_copy()
        if forcing := forced_text_error(probe):
            raise StructuredOutputError(forcing)
        first = probe.compute_bitmask()
        error = matcher.get_error() or probe.get_error()
        if error:
            raise StructuredOutputError(f"the JSON schema cannot be compiled: {error}")
        if not any(first):
            raise StructuredOutputError("the JSON schema allows no output at all")
        # Accepting a token also computes the tokens the grammar forces after it, under the
        # parser's item limit: a long forced run (an array of 100,000 `const` items) passes the
        # first mask and then fails on the first token, on the step thread. Accept the first
        # allowed token here, on the copy, so that such grammars are refused at admission.
        if not probe.consume_token(_first_allowed(first)) or probe.get_error():
            raise StructuredOutputError(
                f"the JSON schema cannot be compiled: {probe.get_error() or 'no token fits'}"
            )
        if forcing := forced_text_error(probe):
            raise StructuredOutputError(forcing)
        return matcher


def _first_allowed(mask: bytes) -> int:
    """The lowest token id a bitmask (llguidance's, little-endian 32-bit words) allows; the
    mask allows one."""
    at = next(i for i, byte in enumerate(mask) if byte)
    return 8 * at + (mask[at] & -mask[at]).bit_length() - 1


CONTROL_TEXT_PREFIX = "\x00"
"""Put before each control token's text in the tokenizer llguidance reads: JSON output never
holds a raw NUL (a string escapes it as \\u0000, and the output is compact), so no output's
text contains a control token's text any more."""


def _text_only_tokenizer_json(tokenizer: Any) -> str:
    """The tokenizer as llguidance reads it (what `llguidance.hf.from_tokenizer` would serialize),
    except that no text tokenizes into a control token.

    Why: where the grammar forces bytes (a `const`, an `enum` value, a property name),
    llguidance tokenizes them with this tokenizer, which (as a Hugging Face tokenizer does)
    parses a control token's text into the token itself. A schema's `"<|im_end|>"` then became
    the control token, which the grammar does not allow as text, and the request failed. Here
    each control token (`engine.chat_prompt.control_tokens`: the rule that user text never
    becomes one) is renamed, in the added tokens and the model's vocabulary, to a text that no
    JSON output holds; ids stay, special tokens stay special (EOS is allowed by id), so the
    forced text is generated as plain text, as any other text is."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError("only fast (Rust) tokenizers are supported")
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    renamed = {text: CONTROL_TEXT_PREFIX + text for text in control_tokens(tokenizer)}
    for token in data["added_tokens"]:
        token["content"] = renamed.get(token["content"], token["content"])
    vocab = data["model"].get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: text -> id
        data["model"]["vocab"] = {renamed.get(text, text): i for text, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [text, score] by id
        data["model"]["vocab"] = [[renamed.get(text, text), score] for text, score in vocab]
    return json.dumps(data)
