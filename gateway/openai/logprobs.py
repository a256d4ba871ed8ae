"""Logprobs as the API reports them: the engine gives token ids and numbers; the token's text
and bytes come from the tokenizer here.

A token's bytes are what it contributes to the output: for a byte-level BPE (GPT-2, Llama 3,
Qwen, the demo model) the bytes its symbols stand for, which may be part of a UTF-8 character;
for a byte-fallback token (`<0xE2>`) its one raw byte; otherwise the UTF-8 of its text. Its
`token` string is those bytes decoded; bytes that are no whole UTF-8 text (part of a character)
are named as OpenAI names them, `bytes:\\xe2\\x80`, so distinct tokens read apart (their text
would all be U+FFFD) in chat and legacy logprobs alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from typing import Any

from tokenizers import decoders

from loramux.engine.outputs import TokenLogprob
from loramux.gateway.openai.shapes import TextLogprobs, TokenLogprobEntry, TopLogprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable symbols of a byte-level vocabulary back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            symbols.append(256 + shifted)
            shifted += 1
    return {chr(s): b for b, s in zip(printable, symbols, strict=True)}


class TokenPieces:
    """Token ids to (text, bytes), remembered per id. Use from one thread (the event loop)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
        self._pieces: dict[int, tuple[str, list[int]]] = {}
        self._names: dict[int, str] = {}
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        self._unshown = frozenset(i for i, t in decoder.items() if t.special)
        """Ids whose text the output leaves out: special tokens, which the detokenizer skips
        (`skip_special_tokens`), the end of a turn among them."""

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """The token's text (a partial character as U+FFFD) and bytes."""
        found = self._pieces.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = self._pieces[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found

    def name(self, token_id: int) -> str:
        """The token's `token` string in logprobs: its text, or `bytes:\\xe2…` (each byte
        escaped) when its bytes are no whole UTF-8 text."""
        found = self._names.get(token_id)
        if found is None:
            raw = bytes(self.piece(token_id)[1])
            try:
                found = raw.decode("utf-8")
            except UnicodeDecodeError:
                found = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._names[token_id] = found
        return found

    def _bytes(self, token_id: int) -> bytes:
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            return b""
        if match := _BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match[1], 16)])
        decoder = _byte_decoder()
        if self._byte_level and all(c in decoder for c in token):
            return bytes(decoder[c] for c in token)
        if token.startswith("\u2581"):  # SentencePiece's word boundary is a space
            return (" " + token[1:]).encode()
        return str(self._tokenizer.decode([token_id])).encode()

    def chat_entries(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]
    ) -> list[TokenLogprobEntry]:
        """A chat choice's `logprobs.content` for these tokens, but those the content does not
        show (special tokens: the end of turn), so that the entries' bytes join to the content,
        as OpenAI's do. The tokens still count in `usage.completion_tokens`; the legacy API
        lists them (`text_logprobs`), as OpenAI's does."""
        entries = []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            if token_id in self._unshown:
                continue
            top = [TopLogprob(self.name(t), p, self.piece(t)[1]) for t, p in lp.top]
            entries.append(
                TokenLogprobEntry(self.name(token_id), lp.logprob, self.piece(token_id)[1], top)
            )
        return entries

    def text_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], offsets: Sequence[int]
    ) -> TextLogprobs:
        """The completions API's logprobs for these tokens, `offsets` their text offsets. Each
        `top_logprobs` entry holds the k most likely tokens and the sampled one (OpenAI: "up to
        logprobs+1 elements"; with `logprobs: 0`, the sampled token alone). Two distinct tokens
        named alike (`name`) share one key, holding the likelier one's logprob."""
        tokens = [self.name(t) for t in token_ids]
        tops = []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            top: dict[str, float] = {}
            for t, p in [*lp.top, (token_id, lp.logprob)]:
                name = self.name(t)
                top[name] = max(p, top.get(name, p))
            tops.append(top)
        return TextLogprobs(tokens, [lp.logprob for lp in logprobs], tops, list(offsets))


def merge_text_logprobs(parts: Sequence[TextLogprobs]) -> TextLogprobs:
    """The logprobs of a whole choice from those of its streamed pieces."""
    return TextLogprobs(
        [t for p in parts for t in p.tokens],
        [x for p in parts for x in p.token_logprobs],
        [d for p in parts for d in p.top_logprobs],
        [o for p in parts for o in p.text_offset],
    )
