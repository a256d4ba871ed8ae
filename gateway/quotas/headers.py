"""Readings as OpenAI writes them: `x-ratelimit-*` headers, and the 429 of a refused request.

Headers describe requests and tokens per minute only, the limits OpenAI's headers name; when the
tenant and its key both set one, the headers show the binding one (fewest remaining). A refusal
carries the same headers plus `retry-after`: the longest wait among the refused limits, in
seconds rounded up, computed from the real reset (when enough admissions leave the window, when
the budget period ends). A full concurrency limit has no known reset; its `retry-after` is 1 s.
Where waiting cannot help (the request alone exceeds a limit, or a token budget is spent for the
period) `x-should-retry: false` tells OpenAI's clients not to retry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loramux.gateway.errors import GatewayError, InsufficientQuota, RateLimited
from loramux.gateway.quotas.readings import NEVER, UNKNOWN, Reading

UNKNOWN_WAIT_MS = 1000
"""The retry-after hint when a concurrency slot frees only as a running request ends."""


def go_duration(ms: int) -> str:
    """A duration the way OpenAI's `x-ratelimit-reset-*` headers write it (Go's
    time.Duration format, to the millisecond): 0s, 120ms, 1s, 1.5s, 6m0s, 1h0m0.25s."""
    ms = max(0, ms)
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    fraction = f".{millis:03d}".rstrip("0") if millis else ""
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return f"{out}{seconds}{fraction}s"


def retry_after(ms: int) -> str:
    """Whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(ms / 1000)))


def rate_limit_headers(readings: Sequence[Reading]) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        of_kind = [r for r in readings if r.kind == kind]
        if not of_kind:
            continue
        binding = min(of_kind, key=lambda r: (r.remaining, r.limit))
        out[f"x-ratelimit-limit-{kind}"] = str(binding.limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(max(0, binding.remaining))
        out[f"x-ratelimit-reset-{kind}"] = go_duration(binding.reset_ms)
    return out


def refusal(readings: Sequence[Reading], tokens: int, key_id: str) -> GatewayError:
    """The 429 for a request some limit refused: `insufficient_quota` when a token budget is
    spent, else `rate_limit_exceeded` typed after the limit with the longest wait."""
    refused = [r for r in readings if not r.fits]
    assert refused, "a refusal needs a refused limit"
    headers = rate_limit_headers(readings)
    waits = [UNKNOWN_WAIT_MS if r.wait_ms == UNKNOWN else r.wait_ms for r in refused]
    if NEVER not in waits:
        headers["retry-after"] = retry_after(max(waits))
    budget = next((r for r in refused if r.kind == "budget"), None)
    if budget is not None or NEVER in waits:
        headers["x-should-retry"] = "false"
    if budget is not None:
        return InsufficientQuota(_message(budget, tokens, key_id), headers=headers)
    worst = max(refused, key=lambda r: (r.wait_ms == NEVER, r.wait_ms))
    limit_type = "tokens" if worst.kind == "tokens" else "requests"
    message = _message(worst, tokens, key_id)
    return RateLimited(message, limit_type=limit_type, refusal=worst.kind, headers=headers)


def _message(r: Reading, tokens: int, key_id: str) -> str:
    scope = "this tenant" if r.scope == "tenant" else f"API key lmx-{key_id}"
    used = r.limit - r.remaining
    wait = go_duration(r.wait_ms)
    if r.kind == "requests":
        if r.wait_ms == NEVER:
            return f"Requests per minute on {scope} are limited to 0."
        return (
            f"Rate limit reached for requests per minute (RPM) on {scope}: limit {r.limit}, "
            f"used {used}, requested 1. Please try again in {wait}."
        )
    if r.kind == "tokens":
        if r.wait_ms == NEVER:
            return (
                f"Request too large for tokens per minute (TPM) on {scope}: limit {r.limit}, "
                f"requested {tokens} (prompt tokens + max_tokens). Reduce the prompt or max_tokens."
            )
        return (
            f"Rate limit reached for tokens per minute (TPM) on {scope}: limit {r.limit}, used "
            f"{used}, requested {tokens} (prompt tokens + max_tokens). Please try again in {wait}."
        )
    if r.kind == "concurrency":
        return (
            f"Too many concurrent requests on {scope}: limit {r.limit}. "
            "Please try again when one has finished."
        )
    if r.wait_ms == NEVER:
        return (
            f"Request exceeds the whole token budget of {scope}: budget {r.limit}, requested "
            f"{tokens} (prompt tokens + max_tokens). Reduce the prompt or max_tokens."
        )
    return (
        f"Token budget spent on {scope}: budget {r.limit}, used {used}, requested {tokens} "
        f"(prompt tokens + max_tokens). The budget renews in {go_duration(r.reset_ms)}."
    )
