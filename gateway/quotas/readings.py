"""What the admission script saw, bucket by bucket, as named values."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from loramux.gateway.quotas.buckets import NO_LIMIT, WINDOW_MS, Bucket, Scope

FITS, NEVER, UNKNOWN = -1, -2, -3
"""Values of `wait_ms` besides a count of milliseconds (see gateway.quotas.scripts.ADMIT)."""

ADMITTED, REFUSED, NEEDS_SEED, ADMITTED_BEFORE, RELEASED = 0, 1, 2, 3, 4
"""The admission script's status (the first value of its reply); ADMITTED_BEFORE: a retry
found the reservation its lost first reply had made; RELEASED: the request was released before
its script ran (it reserved nothing; no caller waits for that reply)."""

LimitKind = Literal["requests", "tokens", "concurrency", "budget"]


@dataclass(frozen=True)
class Reading:
    """One limit of one scope at the moment of admission.

    `remaining` is after this request's reservation when it was admitted, before it when it was
    refused. `reset_ms`: until the limit is back to its full capacity (every admission counted
    now has left the window; the budget period ends). `wait_ms`: FITS, NEVER (this request
    alone exceeds the limit), UNKNOWN (a concurrency slot frees when a running request ends), or
    the milliseconds until this request would fit, unless others take the room first.
    """

    kind: LimitKind
    scope: Scope
    limit: int
    remaining: int
    reset_ms: int
    wait_ms: int

    @property
    def fits(self) -> bool:
        return self.wait_ms == FITS


@dataclass(frozen=True)
class ScriptReply:
    status: int
    readings: list[Reading]
    missing: list[int]
    """Indexes of budget buckets whose ledger must be seeded from SQL (status NEEDS_SEED)."""


def parse_reply(raw: Sequence[int | bytes], buckets: Sequence[Bucket], tokens: int) -> ScriptReply:
    """The reply as readings; ADMITTED_BEFORE reads as ADMITTED."""
    status = int(raw[0])
    if status == NEEDS_SEED:
        return ScriptReply(status, [], [int(i) for i in raw[1:]])
    if status == RELEASED:
        return ScriptReply(status, [], [])
    admitted = status in (ADMITTED, ADMITTED_BEFORE)
    # what this admission takes from each limit, unless the counts include it already
    requests, tokens = (1, tokens) if status == ADMITTED else (0, 0)
    readings: list[Reading] = []
    for index, bucket in enumerate(buckets):
        v = [int(x) for x in raw[1 + 6 * index : 7 + 6 * index]]
        if bucket.kind == "W":
            readings += _window_readings(bucket, v, admitted, requests, tokens)
        elif bucket.kind == "C":
            readings.append(
                Reading("concurrency", bucket.scope, bucket.a, v[0] - requests, 0, v[2])
            )
        else:
            readings.append(Reading("budget", bucket.scope, bucket.a, v[0] - tokens, v[1], v[2]))
    if status == ADMITTED_BEFORE:  # its checks counted the request against itself
        readings = [dataclasses.replace(r, wait_ms=FITS) for r in readings]
    return ScriptReply(ADMITTED if admitted else status, readings, [])


def _window_readings(
    bucket: Bucket, v: list[int], admitted: bool, requests: int, tokens: int
) -> list[Reading]:
    """Requests and tokens of a window bucket, for the limits that are set. An admitted request
    entered the window just now, so the window is back to full capacity in WINDOW_MS."""
    out: list[Reading] = []
    limits: tuple[tuple[LimitKind, int, int, int], ...] = (
        ("requests", bucket.a, 0, requests),
        ("tokens", bucket.b, 3, tokens),
    )
    for kind, limit, base, cost in limits:
        if limit != NO_LIMIT:
            reset = WINDOW_MS if admitted else v[base + 1]
            out.append(Reading(kind, bucket.scope, limit, v[base] - cost, reset, v[base + 2]))
    return out
