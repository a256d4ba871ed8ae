"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: never half a UTF-8 character (the tokenizer renders an
incomplete byte sequence as U+FFFD, which is held back), and never a tail that could still
become a stop string. The deltas therefore concatenate to exactly the final text.

Bytes that never complete a character come out at the end (`flush`) as U+FFFD, as
transformers' decode of the whole output shows them (the Rust decoders' lossy UTF-8); they were
dropped. While a long run is held, only its last few tokens are decoded per token
(`MAX_HELD_TOKENS`): decoding the whole held window twice per token, as vLLM's and TGI's
incremental detokenizers do, costs work quadratic in the run, on the gateway's event loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import TokenizersBackend


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class RustDecoder:
    """A transformers tokenizer's Rust tokenizer, decoding as the transformers tokenizer does
    (`rust_decoder` checks that it would add nothing) without transformers' per-call layers,
    which cost several times the decode itself: detokenizing decodes twice per token."""

    backend: Any

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens))


def rust_decoder(tokenizer: Any) -> Tokenizer:
    """`tokenizer` as a RustDecoder when its `decode` is the Rust tokenizer's decode plus nothing
    (transformers' own `decode` and `_decode`, no clean-up of spaces), else `tokenizer` itself."""
    kind = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is TokenizersBackend.decode
        and kind._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return RustDecoder(tokenizer.backend_tokenizer)
    return tokenizer


@dataclass
class StopMatcher:
    """One stop string, matched as the text grows (Knuth-Morris-Pratt): each character of text is
    looked at once, so a long stop string costs time in proportion to the text, not to the
    text times the stop string's length squared."""

    stop: str
    fail: tuple[int, ...]
    """fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix."""
    matched: int = 0
    """The longest prefix of `stop` (shorter than it) that the text read so far ends with."""

    @classmethod
    def of(cls, stop: str) -> StopMatcher:
        """A matcher at the start of the text; its table is shared by every matcher of `stop`
        (the choices of a request, and the requests that repeat a stop string)."""
        return cls(stop, _failure_table(stop))

    def read(self, text: str, start: int) -> int | None:
        """Read text[start:]; where the stop string's first occurrence ending there starts, or
        None (then `matched` says how much of it the text ends with)."""
        stop, fail, m = self.stop, self.fail, self.matched
        for i in range(start, len(text)):
            c = text[i]
            while m and stop[m] != c:
                m = fail[m - 1]
            if stop[m] == c:
                m += 1
                if m == len(stop):
                    return i + 1 - m
        self.matched = m
        return None


STOP_TABLES = 256
"""Stop strings whose matching tables are kept, least recently used dropped first."""


@functools.lru_cache(maxsize=STOP_TABLES)
def _failure_table(stop: str) -> tuple[int, ...]:
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


MAX_HELD_TOKENS = 4
"""Tokens held back while their text ends in an incomplete character, past which completion is
checked on the last TAIL_TOKENS tokens alone: the window is decoded again only once they end a
character, and at the end. An incomplete UTF-8 character has at most 4 bytes and a token holds
at least one (skipped special tokens aside), so those tokens hold the whole last character and
their decode ends in U+FFFD exactly when the window's does. Decoding the growing window twice
per token, as before, cost work quadratic in a run that never completes a character (lone lead
bytes a tenant forces with logit_bias) or that completes one only at its end (byte-level merges
that straddle characters); now the work per token is bounded, and nothing is cut inside a
character: the run's text comes whole, when it completes or at `flush`."""
TAIL_TOKENS = 4


@dataclass
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    """Stable decoded text so far (truncated at a stop string once one is seen)."""
    prefix_offset: int = 0
    read_offset: int = 0
    """Tokens [prefix_offset, read_offset) are decoded again as left context for the next ones,
    so tokenizers whose decoding depends on the previous token stay right at the window edge."""
    emitted: int = 0
    """Characters of `text` already handed out."""
    stopped: bool = False
    matchers: list[StopMatcher] = field(init=False)

    def __post_init__(self) -> None:
        self.matchers = [StopMatcher.of(s) for s in self.stop]

    def add(self, token_id: int) -> str:
        """Add one generated token; return the newly stable text."""
        self.token_ids.append(token_id)
        if self.stopped:
            return ""
        read = len(self.text)
        self._decode()
        return self._emit(self._stable_end(read))

    def _decode(self, final: bool = False) -> None:
        """Append the text the tokens so far add: none while a character is incomplete, or, at
        the end (`final`), all of it (incomplete bytes as U+FFFD, as the whole output's decode
        shows them)."""
        held = len(self.token_ids) - self.read_offset
        if not final and held > MAX_HELD_TOKENS:
            tail = self.tokenizer.decode(self.token_ids[-TAIL_TOKENS:], skip_special_tokens=True)
            if not tail or tail.endswith("\ufffd"):
                # Still inside a character, or only skipped special tokens since: they add no
                # text, so the window could not have completed one (decoding it again for each
                # was quadratic work again: found by attacking this fix).
                return
        window = self.token_ids[self.prefix_offset :]
        context = self.tokenizer.decode(
            window[: self.read_offset - self.prefix_offset], skip_special_tokens=True
        )
        full = self.tokenizer.decode(window, skip_special_tokens=True)
        if final or (len(full) > len(context) and not full.endswith("\ufffd")):
            self._read(full[len(context) :], len(self.token_ids))

    def _read(self, text: str, read_offset: int) -> None:
        """Take `text` as the text of the tokens up to `read_offset`; they become the next
        decode's left context."""
        self.text += text
        self.prefix_offset, self.read_offset = self.read_offset, read_offset

    def _stable_end(self, read: int) -> int:
        """Where the text that may be handed out ends, the new text starting at `read`. Of the
        stop strings the new text completes (begun in it or before), the text ends before the
        one that starts first, whatever their order in `stop`; else what could begin one is
        held back."""
        starts = [at for m in self.matchers if (at := m.read(self.text, read)) is not None]
        if starts:
            self.stopped = True
            self.text = self.text[: min(starts)]
            return len(self.text)
        return len(self.text) - max((m.matched for m in self.matchers), default=0)

    def flush(self) -> str:
        """At the end of generation, release whatever was held back: a tail that could have
        begun a stop string, and the text of tokens that left a character incomplete (as
        U+FFFD, as the whole output's decode shows it)."""
        if not self.stopped and self.read_offset < len(self.token_ids):
            read = len(self.text)
            self._decode(final=True)
            self._stable_end(read)
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
