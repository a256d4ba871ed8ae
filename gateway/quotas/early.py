"""Refusals known before a request is tokenized.

A requests-per-minute limit that refused one of a principal's requests refuses every request of
that principal until its window frees a slot, `wait_ms` later: a refused request reserves
nothing, and admissions leave the window only with time, whichever gateway admitted them. For
that long this gateway refuses the principal's requests at once, before their prompts are
tokenized, with the 429 the admission script would give (its `x-ratelimit-*-requests` headers,
`retry-after` counted down). Admission comes after tokenizing (it reserves the prompt's
tokens), so without this a principal over its rate limit still had every prompt of a flood
tokenized, the costliest work a request can cause before it is refused.

Only under the limits it was learnt with: once the principal's limits change (an admin raised
them; quota rows are cached for LORAMUX_QUOTA_CONFIG_CACHE_SECONDS), what was known is dropped,
and all of it when Redis may have lost its windows (`clear`, on a dropped connection: a restart
without persistence empties them). A limit of 0 refuses until the limits change. Token limits
are not remembered: a smaller request may fit where a larger one did not (their headers are
repeated, counted down, as the script's 429 carries them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from loramux.gateway.errors import GatewayError
from loramux.gateway.quotas.config import PrincipalLimits
from loramux.gateway.quotas.headers import refusal
from loramux.gateway.quotas.readings import FITS, NEVER, Reading

MAX_KNOWN = 10_000
"""Principals remembered at most; past it, those whose refusal has run out are forgotten, then
the oldest."""


@dataclass(frozen=True)
class _Full:
    limits: PrincipalLimits
    readings: tuple[Reading, ...]
    """The requests- and tokens-per-minute readings, as the admission script read them, only
    the requests ones refused (the tokens ones marked as fitting: they refuse no other
    request)."""
    learnt: float
    until: float


class KnownRefusals:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._full: dict[tuple[str, str], _Full] = {}

    def now(self) -> float:
        """This memo's clock: read it before asking the script, and `learn` with that time."""
        return self._clock()

    def learn(
        self,
        tenant_id: str,
        key_id: str,
        limits: PrincipalLimits,
        readings: Sequence[Reading],
        asked: float,
    ) -> None:
        """The admission script, asked at `asked` (`now()`), refused a request of this
        principal with `readings`: their waits count from then, not from the reply."""
        waits = [r.wait_ms for r in readings if r.kind == "requests" and not r.fits]
        if not waits:
            return
        kept = tuple(
            r if r.kind == "requests" else replace(r, wait_ms=FITS)
            for r in readings
            if r.kind in ("requests", "tokens")
        )
        until = math.inf if NEVER in waits else asked + max(waits) / 1000
        principal = (tenant_id, key_id)
        if len(self._full) >= MAX_KNOWN and principal not in self._full:
            self._forget(self._clock())
        self._full[principal] = _Full(limits, kept, asked, until)

    def clear(self) -> None:
        """Forget everything: Redis may have lost the windows it was learnt from."""
        self._full.clear()

    def refusal(self, tenant_id: str, key_id: str, limits: PrincipalLimits) -> GatewayError | None:
        """The 429 a request of this principal gets now whatever it asks, if known."""
        full = self._full.get((tenant_id, key_id))
        if full is None:
            return None
        now = self._clock()
        if now >= full.until or full.limits != limits:
            del self._full[(tenant_id, key_id)]
            return None
        elapsed = int((now - full.learnt) * 1000)
        readings = [
            replace(
                r,
                reset_ms=max(0, r.reset_ms - elapsed),
                wait_ms=r.wait_ms if r.wait_ms < 0 else max(1, r.wait_ms - elapsed),
            )
            for r in full.readings
        ]
        return refusal(readings, 0, key_id)

    def _forget(self, now: float) -> None:
        for principal in [p for p, full in self._full.items() if now >= full.until]:
            del self._full[principal]
        while len(self._full) >= MAX_KNOWN:
            del self._full[next(iter(self._full))]
