"""Admission: check and reserve a request's place in every limit of its tenant and its key, in
one atomic Redis script, and settle the reservation once the request ends.

Limits, per tenant and per key (a request must fit all of them; a refused request reserves
nothing anywhere):
- requests and tokens per minute, over a sliding 60-second window: at most `rpm` admissions
  and `tpm` tokens in any 60 s, exactly, across every gateway process. A request counts for
  `prompt_tokens + max_tokens` while it runs and for its real usage once settled (if it is still
  in the window);
- concurrent requests, as leased slots (gateway.quotas.leases);
- a token budget per UTC day or month: a ledger per period that is never exceeded, since a
  request reserves its whole `prompt_tokens + max_tokens` up front (gateway.quotas.ledger).

State lives only in Redis; quota rows are read from SQL and cached per key briefly
(gateway.quotas.config). A principal with no limits costs no Redis call and gets no headers.

Redis unavailable (no connection, or no answer within LORAMUX_QUOTA_REDIS_TIMEOUT_MS): with
LORAMUX_QUOTA_ON_REDIS_DOWN=reject (the default) a request with limits gets 503
`quota_unavailable`; with `allow` it is admitted unchecked, without rate-limit headers. Either
way it is counted in `QuotaService.redis_down` (`refused`, `unchecked`; `unsettled` for
settlements that could not reach Redis, kept and tried again until it answers, and `dropped` for
those given up: gateway.quotas.unsettled) and logged at most every 10 s. There is never a
per-process fallback limiter: limits hold across processes or are explicitly not enforced.
(`allow` also admits unchecked when this gateway is too overloaded to hear Redis in time.) When Redis
loses its data (a restart without persistence), windows and slots start empty and budget
ledgers are rebuilt from SQL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.errors import ServiceUnavailable
from loramux.gateway.quotas.admission import Admission, Reservation
from loramux.gateway.quotas.buckets import WINDOW_MS, Bucket, plan, release_mark
from loramux.gateway.quotas.config import QuotaConfig
from loramux.gateway.quotas.early import KnownRefusals
from loramux.gateway.quotas.headers import rate_limit_headers, refusal
from loramux.gateway.quotas.leases import LeaseKeeper
from loramux.gateway.quotas.ledger import Seed, spent_in_period
from loramux.gateway.quotas.readings import (
    NEEDS_SEED,
    REFUSED,
    RELEASED,
    ScriptReply,
    parse_reply,
)
from loramux.gateway.quotas.scripts import ADMIT, CHARGE_LATE, SETTLE
from loramux.gateway.quotas.single_flight import SingleFlight
from loramux.gateway.quotas.unsettled import Unsettled
from loramux.gateway.settings import QuotaSettings
from loramux.gateway.usage import UsageRecorder

log = logging.getLogger(__name__)

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError)
"""Errors that mean Redis cannot be reached (as opposed to a refused command)."""

DOWN_LOG_INTERVAL = 10.0

SEED_ROUNDS = 3
"""Seedings of missing ledgers one admission makes before it gives up (503): a ledger that had
its total can lose it while another is seeded (its budget set again), and is then missing in
turn. Each round reads only the ledgers missing then."""

RELEASE_MARK_MIN_MS = 300_000
"""How long, at least, the release of an admission whose reply never came keeps the request
marked released (and at least a slot lease and a Redis timeout): its script, delayed on the
network past its release, reserves nothing while the mark lasts. A script delayed longer than
this (TCP gives up on a connection within about 15 minutes) would still reserve."""


class QuotaService:
    """Admission for every request of one gateway process (one event loop).

    `clock`: seconds since the epoch, for tests; by default windows and slot leases use Redis's
    clock (one clock for every gateway) and budget periods this machine's UTC date. `usage`:
    this process's usage recorder, whose events not yet written a rebuilt ledger counts.
    """

    def __init__(
        self,
        redis: Redis,
        sessions: async_sessionmaker[AsyncSession],
        settings: QuotaSettings,
        clock: Callable[[], float] | None = None,
        usage: UsageRecorder | None = None,
    ):
        self.redis = redis
        self.sessions = sessions
        self.settings = settings
        self.clock = clock
        self.usage = usage
        self.config = QuotaConfig(sessions, settings.config_cache_seconds)
        self.timeout = settings.redis_timeout_ms / 1000
        lease_ms = int(settings.slot_lease_seconds * 1000)
        self.leases = LeaseKeeper(redis, lease_ms, self._now_ms, self.timeout)
        self.mark_ms = max(RELEASE_MARK_MIN_MS, self.leases.lease_ms, settings.redis_timeout_ms)
        self.redis_down: Counter[str] = Counter()
        """What Redis being unavailable did: `refused` (503), `unchecked` (admitted without a
        check, `allow`), `unsettled` (settlements Redis did not take at once, then retried),
        `dropped` (settlements given up: their reservations stay charged)."""
        self._admit = redis.register_script(ADMIT)
        self._settle = redis.register_script(SETTLE)
        self._charge_late = redis.register_script(CHARGE_LATE)
        self._seeds: SingleFlight[str, Seed] = SingleFlight()
        self._settling: set[asyncio.Task[None]] = set()
        self.unsettled = Unsettled(self._settle_once, settings.max_unsettled, self.redis_down)
        """Settlements waiting for Redis to answer again."""
        self._down_logged = -DOWN_LOG_INTERVAL
        self.known = KnownRefusals(clock or time.monotonic)
        """Principals whose requests are refused for now whatever they ask."""

    async def refuse_early(self, principal: Principal) -> None:
        """Raise the 429 any request of `principal` gets now, when this gateway already knows it
        (gateway.quotas.early): before the request's prompt is tokenized. Costs no Redis call;
        does nothing when the limits cannot be read (admission then says why)."""
        try:
            limits = await self.config.limits(principal.tenant_id, principal.key_id)
        except Exception:
            return
        known = self.known.refusal(principal.tenant_id, principal.key_id, limits)
        if known is not None:
            raise known

    async def admit(self, principal: Principal, prompt_tokens: int, max_tokens: int) -> Admission:
        """Reserve `prompt_tokens + max_tokens` in every limit of the principal, or refuse:
        RateLimited / InsufficientQuota (429), or ServiceUnavailable (503) when the limits cannot
        be read or checked. Raises nothing else, but CancelledError: a caller cancelled (a
        client disconnect) while its script is in flight leaves nothing reserved."""
        try:
            limits = await self.config.limits(principal.tenant_id, principal.key_id)
        except Exception:
            log.exception("quota configuration unreadable")
            raise ServiceUnavailable(
                "quota configuration unavailable; try again shortly", code="quota_unavailable"
            ) from None
        now = self._now()
        buckets = plan(principal.tenant_id, principal.key_id, limits, now)
        if not buckets:
            return Admission.unlimited(now)
        tokens = prompt_tokens + max_tokens
        member = secrets.token_hex(8)
        reservation = Reservation(
            member, tokens, tuple(buckets), release_mark(principal.tenant_id, member)
        )
        asked = self.known.now()
        reply = await self._check(principal, reservation)
        if reply is None:
            return Admission.unlimited(now)
        if reply.status == REFUSED:
            self.known.learn(principal.tenant_id, principal.key_id, limits, reply.readings, asked)
            raise refusal(reply.readings, tokens, principal.key_id)
        slots = tuple(b.keys[0] for b in buckets if b.kind == "C")
        if slots:
            self.leases.hold(member, slots)
        return Admission(now, rate_limit_headers(reply.readings), reservation, self._release)

    async def close(self) -> None:
        """Stop renewing slots, wait for settlements under way, and try those waiting for
        Redis once more."""
        await self.leases.close()
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        await self.unsettled.close()

    # -- Redis -------------------------------------------------------------------------------
    async def _check(self, principal: Principal, r: Reservation) -> ScriptReply | None:
        """The admission script's reply; None when Redis is down and `allow` is configured."""
        seeds: dict[int, Seed] = {}
        sent: list[tuple[int, Seed, int]] = []  # each seed sent, of every round
        try:
            reply = await self._run_admit(r, {})
            for _ in range(SEED_ROUNDS):
                if reply.status != NEEDS_SEED:
                    break
                seeds |= await self._read_seeds(principal.tenant_id, r.buckets, reply.missing)
                values = {i: s.now() for i, s in seeds.items()}
                sent += [(i, seeds[i], v) for i, v in values.items()]
                reply = await self._run_admit(r, values)
        except asyncio.CancelledError:
            # The caller left (a client disconnect) with a script sent: Redis still runs it.
            self._release_lost(r, sent)
            raise
        except REDIS_DOWN as exc:
            self.known.clear()  # Redis may come back without its windows
            self._release_lost(r, sent)
            self._redis_down(exc)
            return None
        except RedisError:
            log.exception("quota admission script failed")
            await self._charge_recorded_late(r, sent)  # an earlier round may have set totals
            raise ServiceUnavailable(
                "quota service error; try again shortly", code="quota_unavailable"
            ) from None
        except ServiceUnavailable:  # a seed unread: an earlier round may have set totals
            await self._charge_recorded_late(r, sent)
            raise
        assert reply.status != RELEASED, "only an admission given up on is released"
        await self._charge_recorded_late(r, sent)
        if reply.status == NEEDS_SEED:  # nothing reserved: ledgers lost totals round after round
            raise ServiceUnavailable(
                "token budget unavailable; try again shortly", code="quota_unavailable"
            )
        return reply

    async def _charge_recorded_late(
        self, r: Reservation, sent: list[tuple[int, Seed, int]]
    ) -> None:
        """Charge each ledger whose total one of `r`'s seeds set the tokens recorded while that
        seed was on its way to Redis (a request that ended then may have settled before the
        ledger had a total): counted twice at worst, never missed (gateway.quotas.ledger).
        `sent`: each seed sent (bucket index, its Seed, the value), of every round; the script
        charges only for the seed that set the total (neither another round's, nor another
        admission's sharing the read), once. Best effort: the admission stands."""
        late = [(r.buckets[i].keys[0], f"{r.member}/{v}", seed.now() - v) for i, seed, v in sent]
        if not late:
            return
        keys = [key for key, _, _ in late]
        args = [x for _, mark, tokens in late for x in (mark, tokens)]
        try:
            async with asyncio.timeout(self.timeout):
                await self._charge_late(keys=keys, args=args)
        except (RedisError, TimeoutError):
            log.warning("tokens recorded while ledgers %s were seeded were not charged", keys)

    async def _run_admit(self, r: Reservation, seeds: dict[int, int]) -> ScriptReply:
        keys = [k for b in r.buckets for k in b.keys] + [r.mark]
        args: list[int | str] = [
            self._now_ms(),
            r.member,
            r.tokens,
            WINDOW_MS,
            self.leases.lease_ms,
        ]
        for index, b in enumerate(r.buckets):
            args += [b.kind, b.a, b.b, seeds.get(index, -1)]
        async with asyncio.timeout(self.timeout):
            raw = await _once_more_on_reconnect(
                lambda: self._admit(keys=keys, args=args), self.known.clear
            )
        return parse_reply(raw, r.buckets, r.tokens)

    async def _read_seeds(
        self, tenant_id: str, buckets: tuple[Bucket, ...], missing: list[int]
    ) -> dict[int, Seed]:
        """Spent tokens of each missing ledger's scope and period, from SQL and this process's
        unwritten usage events (shared by concurrent admissions that miss the same ledger)."""
        seeds: dict[int, Seed] = {}
        for index in missing:
            b = buckets[index]
            assert b.period is not None

            async def read(b: Bucket = b) -> Seed:
                assert b.period is not None
                return await spent_in_period(
                    self.sessions, tenant_id, b.key_id, b.period, self.usage
                )

            try:
                seeds[index] = await self._seeds.run(b.keys[0], read)
            except Exception:
                log.exception("token budget ledger %s could not be read from SQL", b.keys[0])
                raise ServiceUnavailable(
                    "token budget unavailable; try again shortly", code="quota_unavailable"
                ) from None
        return seeds

    def _release_lost(self, r: Reservation, sent: list[tuple[int, Seed, int]]) -> None:
        """An admission whose reply never came (lost with Redis, or its caller cancelled): had
        the script run, settling with 0 releases what it reserved, in a task of its own. The
        settlement also marks the request released, for RELEASE_MARK_MIN_MS at least: its
        script may still be on its way (a connection that stalled, then timed out or was
        cancelled; the settlement goes on another), and reserves nothing if it comes after.
        Then, in the same task, what was recorded while its seeds (`sent`) were on their way is
        charged, should one of them have set a ledger's total: a script coming after the
        release seeds nothing."""
        self._spawn(self._release_then_charge(dataclasses.replace(r, lost=True), sent))

    async def _release_then_charge(self, r: Reservation, sent: list[tuple[int, Seed, int]]) -> None:
        """`_release_lost`'s task: the release, then the late charge."""
        await self._settle_now(r, 0, quiet=True)
        await self._charge_recorded_late(r, sent)

    def _redis_down(self, exc: BaseException) -> None:
        """Refuse (raise), or admit unchecked, as configured; counted and logged either way."""
        if self.settings.on_redis_down == "reject":
            self._note_outage("refused", exc)
            raise ServiceUnavailable(
                "quota service unavailable (Redis cannot be reached); try again shortly",
                code="quota_unavailable",
                headers={"retry-after": "1"},
            )
        self._note_outage("unchecked", exc)

    def _note_outage(self, what: str, exc: BaseException) -> None:
        self.redis_down[what] += 1
        now = time.monotonic()
        if now - self._down_logged >= DOWN_LOG_INTERVAL:
            self._down_logged = now
            log.warning(
                "Redis unavailable for quotas (%s): %s",
                repr(exc) if str(exc) else f"no answer within {self.timeout:g} s",
                ", ".join(f"{k} {v}" for k, v in sorted(self.redis_down.items())),
            )

    async def _release(self, reservation: Reservation, used_tokens: int) -> None:
        """Settle in a task of its own, so a caller cancelled mid-way (a client disconnect)
        still settles; waits for it unless cancelled."""
        self.leases.release(reservation.member)
        await asyncio.shield(self._spawn(self._settle_now(reservation, used_tokens)))

    def _spawn(self, settlement: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a settlement in a task of its own, kept until done (`close` waits for it)."""
        task = asyncio.get_running_loop().create_task(settlement)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    async def _settle_now(self, r: Reservation, used_tokens: int, quiet: bool = False) -> None:
        """Settle, or keep the settlement to try again while Redis does not take it (counted
        as `unsettled` unless `quiet`: an admission whose reply was lost)."""
        try:
            await self._settle_once(r, used_tokens)
        except (*REDIS_DOWN, RedisError) as exc:
            if not quiet:
                self._note_outage("unsettled", exc)
            self.unsettled.put(r, used_tokens)

    async def _settle_once(self, r: Reservation, used_tokens: int) -> None:
        """One settlement round trip (raises when Redis does not take it)."""
        keys = [k for b in r.buckets for k in b.keys] + [r.mark]
        mark_ms = self.mark_ms if r.lost else 0
        args: list[int | str] = [r.member, used_tokens, mark_ms, *(b.kind for b in r.buckets)]
        async with asyncio.timeout(self.timeout):
            await _once_more_on_reconnect(
                lambda: self._settle(keys=keys, args=args), self.known.clear
            )

    # -- clocks ------------------------------------------------------------------------------
    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock() if self.clock else time.time(), UTC)

    def _now_ms(self) -> int:
        """The scripts' clock: the injected one, else -1 (Redis's own)."""
        return int(self.clock() * 1000) if self.clock else -1


async def _once_more_on_reconnect(
    call: Callable[[], Awaitable[Any]], reconnecting: Callable[[], None]
) -> Any:
    """`call()`, repeated once on a fresh connection if the first failed on its connection:
    every pooled connection fails once after Redis restarts (`reconnecting()` is told first).
    The scripts are idempotent per request (a repeat finds the reservation a lost reply made),
    so nothing counts twice."""
    try:
        return await call()
    except RedisConnectionError:
        reconnecting()
        return await call()
