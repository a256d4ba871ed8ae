"""From landed tokens to what callers receive: token-id deltas and, at the end, usage.

The scheduler ends a request on tokens (a stop token, max_tokens, the context length); callers
end it by aborting it (a gateway that matched a stop string in its own detokenized text, a
client that left). The engine never handles text.
"""

from __future__ import annotations

import time

from engine.outputs import RequestOutput, RequestTimings, Usage
from engine.sequence import FinishReason, Sequence


class OutputProcessor:
    """Holds every active request; a request is active from `add` until its final output
    (`final`)."""

    def __init__(self) -> None:
        self._active: dict[str, Sequence] = {}

    def get(self, request_id: str) -> Sequence | None:
        return self._active.get(request_id)

    def add(self, seq: Sequence) -> None:
        self._active[seq.request_id] = seq

    def final(
        self,
        seq: Sequence,
        reason: FinishReason,
        token_ids: list[int] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """The request's last delta, with usage; it is no longer active afterwards."""
        self._active.pop(seq.request_id, None)
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens)
        timings = RequestTimings(
            seq.arrival_time, seq.scheduled_time, seq.first_token_time, time.time()
        )
        return RequestOutput(seq.request_id, token_ids or [], reason, usage, error, timings)
