"""From landed tokens to what callers receive: streamed text deltas, stop strings and usage.

The scheduler ends a request on tokens (a stop token, max_tokens, the context length). Stop
strings are text, so they are found here, after detokenizing; the engine then ends the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput, Usage
from engine.sequence import FinishReason, Sequence


@dataclass
class _Active:
    seq: Sequence
    detok: IncrementalDetokenizer


class OutputProcessor:
    """Holds every active request and its detokenizer; a request is active from `add` until
    its final output (`final`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._active: dict[str, _Active] = {}

    def get(self, request_id: str) -> Sequence | None:
        active = self._active.get(request_id)
        return None if active is None else active.seq

    def add(self, seq: Sequence) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, stop=seq.params.stop)
        self._active[seq.request_id] = _Active(seq, detok)

    def add_token(self, seq: Sequence, token: int) -> tuple[str, bool]:
        """The text `token` makes stable, and whether it completed a stop string (the text then
        ends before it)."""
        detok = self._active[seq.request_id].detok
        text = detok.add(token)
        return text, detok.stopped

    def final(
        self,
        seq: Sequence,
        reason: FinishReason,
        text: str = "",
        token_ids: list[int] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """The request's last delta, with usage; it is no longer active afterwards. Held-back
        text is handed out unless the request failed (`error`) or had already ended (its
        ending raised once)."""
        active = self._active.pop(seq.request_id, None)
        if active is not None and error is None:
            text += active.detok.flush()
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens)
        return RequestOutput(seq.request_id, text, token_ids or [], reason, usage, error)
