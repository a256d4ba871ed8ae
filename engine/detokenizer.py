"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: never half a UTF-8 character (the tokenizer renders an
incomplete byte sequence as U+FFFD, which is held back), and never a tail that could still
become a stop string. The deltas therefore concatenate to exactly the final text.
"""

from __future__ import annotations

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

    def add(self, token_id: int) -> str:
        """Add one generated token; return the newly stable text."""
        self.token_ids.append(token_id)
        if self.stopped:
            return ""
        window = self.token_ids[self.prefix_offset :]
        context = self.tokenizer.decode(
            window[: self.read_offset - self.prefix_offset], skip_special_tokens=True
        )
        full = self.tokenizer.decode(window, skip_special_tokens=True)
        if len(full) > len(context) and not full.endswith("\ufffd"):
            self.text += full[len(context) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        stable_end = len(self.text)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1 and at < stable_end:
                self.stopped = True
                self.text = self.text[:at]
                stable_end = at
        if not self.stopped:
            stable_end = min(stable_end, self._stop_prefix_start())
        return self._emit(stable_end)

    def flush(self) -> str:
        """At the end of generation, release whatever was held back."""
        return self._emit(len(self.text))

    def _stop_prefix_start(self) -> int:
        """Where a suffix of `text` that begins some stop string starts (len(text) if none)."""
        start = len(self.text)
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    start = min(start, len(self.text) - k)
                    break
        return start

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
