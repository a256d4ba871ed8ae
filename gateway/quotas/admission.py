"""An admitted request's hold on its limits, released by exactly one `settle`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from loramux.gateway.quotas.buckets import Bucket


@dataclass(frozen=True)
class Reservation:
    """What one admission reserved: `tokens` in every bucket, under the id `member`."""

    member: str
    tokens: int
    buckets: tuple[Bucket, ...]
    mark: str
    """The key that marks `member` released (gateway.quotas.buckets.release_mark)."""
    lost: bool = False
    """An admission whose reply never came: its script may still reach Redis after the
    settlement, so the settlement marks the member released (it then reserves nothing)."""


Release = Callable[[Reservation, int], Awaitable[None]]


class Admission:
    """A request's place in its limits.

    `headers`: the `x-ratelimit-*` headers for its response, for the limits that are set (none
    when nothing is limited, or when Redis was down and `allow` is configured).

    `settle(used_tokens)` reconciles the reservation with the real usage (prompt plus completion
    tokens; 0 for a request that produced nothing, or a cache hit) and frees its concurrency
    slot. Only the first call acts; later ones return at once. It never raises: when Redis
    cannot be reached the slot expires with its lease. A caller cancelled while settling (a
    client disconnect) does not stop the settlement.
    """

    def __init__(
        self,
        admitted_at: datetime,
        headers: dict[str, str],
        reservation: Reservation | None,
        release: Release | None,
    ):
        self.admitted_at = admitted_at
        """The time the limits were checked by (the quota clock): the budget period this
        request is charged in; its usage event records it."""
        self.headers = headers
        self._reservation = reservation
        self._release = release
        self._settled = False

    @classmethod
    def unlimited(cls, admitted_at: datetime) -> Admission:
        """An admission that holds nothing (no limits set, or unchecked)."""
        return cls(admitted_at, {}, None, None)

    @property
    def settled(self) -> bool:
        return self._settled

    async def settle(self, used_tokens: int) -> None:
        if self._settled:
            return
        self._settled = True
        if self._reservation is not None and self._release is not None:
            await self._release(self._reservation, max(0, used_tokens))
