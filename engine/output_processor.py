"""From landed tokens to what callers receive: token-id deltas and, at the end, usage.

The scheduler ends a choice on tokens (a stop token, max_tokens, the context length); callers
end a request by aborting it (a gateway that matched a stop string in its own detokenized text,
a client that left). The engine never handles text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loramux.engine.errors import RequestFailedError
from loramux.engine.outputs import RequestOutput, RequestTimings, TokenLogprob, Usage
from loramux.engine.sequence import FinishReason, Sequence


@dataclass
class _Request:
    choices: list[Sequence]
    """Every choice, by index."""
    open: set[int] = field(default_factory=set)
    """Indexes of the choices that have not had their final output yet."""


class OutputProcessor:
    """Holds every active request; a request is active from `add` until the final output of
    its last open choice (`final`)."""

    def __init__(self) -> None:
        self._active: dict[str, _Request] = {}

    def open_choices(self, request_id: str) -> list[Sequence]:
        """The request's choices that have not ended, by index; empty for an unknown one."""
        request = self._active.get(request_id)
        if request is None:
            return []
        return [request.choices[i] for i in sorted(request.open)]

    def is_open(self, seq: Sequence) -> bool:
        request = self._active.get(seq.request_id)
        return (
            request is not None
            and request.choices[seq.index] is seq
            and (seq.index in request.open)
        )

    def add(self, choices: list[Sequence]) -> None:
        """Make a request active: its choices, choice i at index i."""
        assert [c.index for c in choices] == list(range(len(choices)))
        self._active[choices[0].request_id] = _Request(choices, set(range(len(choices))))

    def delta(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """An open choice's delta of one token."""
        return RequestOutput(
            seq.request_id,
            [token],
            index=seq.index,
            logprobs=None if logprob is None else [logprob],
        )

    def final(
        self,
        seq: Sequence,
        reason: FinishReason,
        token_ids: list[int] | None = None,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
        error_type: type[RequestFailedError] = RequestFailedError,
    ) -> RequestOutput:
        """An open choice's last delta; with usage when it is the request's last open choice,
        which then is no longer active."""
        request = self._active[seq.request_id]
        request.open.discard(seq.index)
        usage = timings = None
        if not request.open:
            del self._active[seq.request_id]
            first = request.choices[0]
            completion = sum(c.num_completion_tokens for c in request.choices)
            usage = Usage(first.num_prompt_tokens, completion, first.num_cached_tokens)
            timings = RequestTimings(
                first.arrival_time, first.scheduled_time, first.first_token_time, time.time()
            )
        return RequestOutput(
            seq.request_id,
            token_ids or [],
            reason,
            usage,
            error,
            seq.index,
            logprobs,
            timings,
            error_type=error_type,
        )
