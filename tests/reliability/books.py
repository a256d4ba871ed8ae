"""Reading back what a load left behind, and checking it against what the clients saw: the engine
idle (no KV block in use, no adapter slot pinned), no quota reservation open in Redis, every
usage event written, and usage in SQL equal to what was received plus what was charged for
requests whose clients left.

The billing rule: a request is billed the prompt and completion tokens the engine computed for
it, whether or not its client stayed to read them (a client that disconnects after the engine
generated 20 tokens pays for 20); a cache hit is billed nothing; a refused request is billed
nothing and leaves no usage event. Every request the gateway received has exactly one event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from sqlalchemy import func, select

from loramux.gateway.db import UsageEvent
from loramux.gateway.engine_client.local import LocalEngineClient
from loramux.gateway.quotas.buckets import budget_period, scope_prefix
from loramux.gateway.server import RunningServer
from tests.reliability.rig import eventually, on_gateway
from tests.reliability.traffic import Outcome, Tenant


@dataclass(frozen=True)
class UsageRow:
    request_id: str
    tenant_id: str
    prompt_tokens: int
    completion_tokens: int
    cache: str
    status: int

    @property
    def billed(self) -> int:
        return self.prompt_tokens + self.completion_tokens


async def pending_usage_events(server: RunningServer, seconds: float = 15) -> int:
    """Usage events still not in SQL once the recorder's own background flushes have stopped
    adding any (for two of their intervals; `seconds` at most): what a forced flush then writes."""
    interval = server.state.usage.interval
    last, steady_since = -1, time.monotonic()
    deadline = steady_since + seconds
    while time.monotonic() < deadline:
        stored = await on_gateway(server, _count_events(server))
        if stored != last:
            last, steady_since = stored, time.monotonic()
        elif time.monotonic() - steady_since > 2 * interval:
            break
        await asyncio.sleep(0.05)
    return await on_gateway(server, server.state.usage.flush())


async def _count_events(server: RunningServer) -> int:
    async with server.state.sessions() as session:
        return int(await session.scalar(select(func.count()).select_from(UsageEvent)) or 0)


async def usage_rows(server: RunningServer, tenants: Sequence[Tenant]) -> list[UsageRow]:
    """Every usage event of `tenants` in SQL, after flushing the recorder."""
    return await on_gateway(server, stored_usage(server, tenants))


async def stored_usage(server: RunningServer, tenants: Sequence[Tenant]) -> list[UsageRow]:
    """`usage_rows`, to run on the gateway's event loop (`server.run`, from another thread)."""
    await server.state.usage.flush()
    query = select(UsageEvent).where(UsageEvent.tenant_id.in_([t.id for t in tenants]))
    async with server.state.sessions() as session:
        events = (await session.scalars(query)).all()
    return [
        UsageRow(e.request_id, e.tenant_id, e.prompt_tokens, e.completion_tokens, e.cache, e.status)
        for e in events
    ]


# -- the engine and Redis at rest ---------------------------------------------------------------
@dataclass(frozen=True)
class Residue:
    """What requests still hold; all zero once every request has ended."""

    running: int
    waiting: int
    kv_blocks_used: int
    pinned_adapter_slots: int
    open_reservations: dict[str, list[str]]

    @property
    def idle(self) -> bool:
        return (
            self.running == self.waiting == self.kv_blocks_used == self.pinned_adapter_slots == 0
            and not self.open_reservations
        )


async def residue(server: RunningServer, redis_url: str, tenants: Sequence[Tenant]) -> Residue:
    stats = [s for s in await on_gateway(server, server.state.engine.stats()) if s is not None]
    return Residue(
        running=sum(s.running for s in stats),
        waiting=sum(s.waiting for s in stats),
        kv_blocks_used=sum(s.kv_blocks_used for s in stats),
        pinned_adapter_slots=pinned_adapter_slots(server),
        open_reservations=open_reservations(redis_url, tenants),
    )


async def settled_residue(
    server: RunningServer, redis_url: str, tenants: Sequence[Tenant], seconds: float = 30
) -> Residue:
    """The residue once it is gone, or as it is after `seconds`."""
    return await eventually(lambda: residue(server, redis_url, tenants), _idle, seconds)


def _idle(r: Residue) -> bool:
    return r.idle


def pinned_adapter_slots(server: RunningServer) -> int:
    """Pins on the in-process engine's adapter slots (a remote engine's are not visible: 0)."""
    client = server.state.engine
    if not isinstance(client, LocalEngineClient) or client.engine.engine.lora is None:
        return 0
    return sum(slot.pins for slot in client.engine.engine.lora.slots)


def open_reservations(redis_url: str, tenants: Sequence[Tenant]) -> dict[str, list[str]]:
    """Concurrency slots held (their lease not expired) and budget reservations not settled, by
    Redis key."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    out: dict[str, list[str]] = {}
    try:
        seconds, micros = client.time()
        now_ms = seconds * 1000 + micros // 1000
        for t in tenants:
            for key in client.scan_iter(match=f"lmx:q:{{{t.id}}}:*"):
                members: list[str]
                if key.endswith(":conc"):
                    members = [str(m) for m in client.zrangebyscore(key, now_ms, "+inf")]
                elif ":budget:" in key:
                    members = [str(f) for f in client.hkeys(key) if f not in ("spent", "seeded")]
                else:
                    continue
                if members:
                    out[key] = members
    finally:
        client.close()
    return out


def budget_spent(redis_url: str, tenant: Tenant) -> int | None:
    """Tokens today's budget ledger of the tenant says were spent (None: no ledger)."""
    key = f"{scope_prefix(tenant.id, None)}:budget:{budget_period('day', datetime.now(UTC)).name}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        spent = client.hget(key, "spent")
    finally:
        client.close()
    return None if spent is None else int(spent)


# -- the books -----------------------------------------------------------------------------------
def server_errors(outcomes: Sequence[Outcome]) -> list[str]:
    """Every 5xx answer and every error event inside a stream."""
    return [
        f"#{o.plan.index} ({o.plan.ending}): {o.status} {o.error or o.stream_error or ''}"
        for o in outcomes
        if (o.status is not None and o.status >= 500) or o.stream_error is not None
    ]


def unclean_failures(outcomes: Sequence[Outcome], codes: set[str] | None = None) -> list[str]:
    """Answers other than 200 or a 503 (with an error code in `codes`, unless None), at the
    head or inside a stream: how a request may fail while a part is down."""
    problems = []
    for o in outcomes:
        error = o.error if o.status != 200 else o.stream_error
        if o.status == 200 and error is None:
            continue
        code = (error or {}).get("code")
        head_ok = o.status in (200, 503)
        if o.status is None or not head_ok or (codes is not None and code not in codes):
            problems.append(f"#{o.plan.index}: {o.status} {error}")
    return problems


def unfinished(outcomes: Sequence[Outcome]) -> list[str]:
    """Requests read to their end that did not end as a whole answer with its usage."""
    return [
        f"#{o.plan.index}: status {o.status}, done {o.done}, finish {o.finish_reason}, "
        f"usage {o.usage}"
        for o in outcomes
        if o.plan.ending == "complete"
        and not (o.status == 200 and o.done and o.finish_reason and o.usage)
    ]


def misrefused(outcomes: Sequence[Outcome]) -> list[str]:
    """Bad requests not refused with a 4xx (the planned status where it is not a plain 400)."""
    return [
        f"#{o.plan.index}: {o.status} for {o.plan.body[:80]!r}"
        for o in outcomes
        if o.plan.ending == "bad"
        and not (
            o.status == o.plan.expect or (o.plan.expect == 400 and 400 <= (o.status or 0) < 500)
        )
    ]


def billing_errors(outcomes: Sequence[Outcome], rows: Sequence[UsageRow]) -> list[str]:
    """Where usage in SQL departs from what clients received (see the module docstring)."""
    problems: list[str] = []
    by_id: dict[str, list[UsageRow]] = defaultdict(list)
    for row in rows:
        by_id[row.request_id].append(row)
    prompt_tokens = {
        o.plan.messages_key: o.usage["prompt_tokens"] for o in outcomes if o.usage is not None
    }
    seen = {o.request_id for o in outcomes if o.request_id is not None}
    for o in outcomes:
        if o.request_id is None:
            continue
        found = by_id.get(o.request_id, [])
        if o.plan.ending == "bad" or (o.status or 0) >= 400:
            # A refusal is recorded as an outcome (the dashboard counts it), once, billing nothing.
            billed = [r for r in found if r.prompt_tokens or r.completion_tokens]
            if billed or len(found) > 1 or any(r.status != o.status for r in found):
                problems.append(f"#{o.plan.index}: refused with {o.status} yet metered {found}")
            continue
        if len(found) != 1:
            problems.append(f"#{o.plan.index} ({o.plan.ending}): {len(found)} usage events")
            continue
        row = found[0]
        if o.received_all:
            problems += _received(o, row)
        else:
            problems += _left_early(o, row, prompt_tokens.get(o.plan.messages_key))
    problems += _cancelled_unseen(outcomes, [r for r in rows if r.request_id not in seen])
    return problems


def _cancelled_unseen(outcomes: Sequence[Outcome], unmatched: Sequence[UsageRow]) -> list[str]:
    """Usage events whose request id no client learnt: requests cancelled before their answer's
    head. A cancelled request whose body never reached the socket does not exist; one whose
    body did may still never be read by the gateway (the client left first), so per tenant
    there are at most as many such events as requests cancelled after sending, and each bills
    one of their prompts and at most their max_tokens, or nothing when they left before the
    engine generated a token."""
    problems = []
    for tenant_id in {r.tenant_id for r in unmatched} | {o.tenant_id for o in outcomes}:
        cancelled = [
            o
            for o in outcomes
            if o.tenant_id == tenant_id
            and o.plan.ending == "cancel"
            and o.body_sent
            and o.request_id is None
        ]
        mine = [r for r in unmatched if r.tenant_id == tenant_id]
        # A request cancelled while its body was still being sent is recorded as a refused
        # outcome when the gateway had its headers (status 4xx, nothing billed): only events
        # that bill something must belong to a request cancelled after sending.
        billed = [r for r in mine if r.prompt_tokens or r.completion_tokens or r.status < 400]
        if len(billed) > len(cancelled):
            problems.append(
                f"tenant {tenant_id}: {len(billed)} usage events of unknown requests, "
                f"{len(cancelled)} requests cancelled before their answer"
            )
        prompts = {_prompt_of(outcomes, o) for o in cancelled} | {0}
        most = max((o.plan.max_tokens for o in cancelled), default=0)
        problems += [
            f"tenant {tenant_id}: {r} bills no cancelled request's prompt and max_tokens"
            for r in mine
            if r.prompt_tokens not in prompts
            or r.completion_tokens > most
            or (r.prompt_tokens == 0) != (r.completion_tokens == 0)
        ]
    return problems


def _prompt_of(outcomes: Sequence[Outcome], cancelled: Outcome) -> int | None:
    """Prompt tokens of the cancelled request's message, as another request's usage shows."""
    for o in outcomes:
        if o.usage is not None and o.plan.messages_key == cancelled.plan.messages_key:
            return o.usage["prompt_tokens"]
    return None


def unbilled(outcomes: Sequence[Outcome], rows: Sequence[UsageRow]) -> list[str]:
    """Requests answered whole whose usage event is missing or wrong, and request ids metered
    more than once: what a fault must never cause."""
    count = Counter(r.request_id for r in rows)
    by_id = {r.request_id: r for r in rows}
    problems = [f"{rid}: {n} usage events" for rid, n in count.items() if n > 1]
    for o in outcomes:
        if o.status == 200 and o.done and o.usage is not None and o.stream_error is None:
            row = by_id.get(o.request_id or "")
            if row is None:
                problems.append(f"#{o.plan.index}: answered, {o.usage}, but no usage event")
            else:
                problems += _received(o, row)
    return problems


def _received(o: Outcome, row: UsageRow) -> list[str]:
    assert o.usage is not None or o.status != 200
    expected = (0, 0) if o.cache in ("exact", "semantic") else _tokens(o)
    got = (row.prompt_tokens, row.completion_tokens)
    problems = []
    if got != expected:
        problems.append(f"#{o.plan.index}: received usage {_tokens(o)} ({o.cache}), billed {got}")
    if row.status != 200:
        problems.append(f"#{o.plan.index}: answered 200 but metered with status {row.status}")
    return problems


def _left_early(o: Outcome, row: UsageRow, prompt: int | None) -> list[str]:
    """A client that left was billed what the engine computed: the whole prompt, and at least
    the completion tokens it was sent (every content chunk holds one or more) up to max_tokens.
    A client that left before any content may have left before the engine generated a token:
    then nothing was computed to the end and nothing is billed (README, "Quotas")."""
    if o.content_chunks == 0 and (row.prompt_tokens, row.completion_tokens) == (0, 0):
        return []
    problems = []
    if prompt is None or row.prompt_tokens != prompt:
        problems.append(
            f"#{o.plan.index} ({o.plan.ending} after {o.content_chunks} chunks): billed "
            f"{row.prompt_tokens} prompt tokens, the prompt has {prompt}"
        )
    if not o.content_chunks <= row.completion_tokens <= o.plan.max_tokens:
        problems.append(
            f"#{o.plan.index} ({o.plan.ending}): billed {row.completion_tokens} completion tokens "
            f"after sending {o.content_chunks} content chunks (max_tokens {o.plan.max_tokens})"
        )
    return problems


def _tokens(o: Outcome) -> tuple[int, int]:
    assert o.usage is not None
    return o.usage["prompt_tokens"], o.usage["completion_tokens"]


def totals(outcomes: Sequence[Outcome], rows: Sequence[UsageRow]) -> dict[str, tuple[int, int]]:
    """Per tenant: (billed in SQL, received by clients + charged to clients that left)."""
    seen = {o.request_id for o in outcomes if o.received_all and o.request_id is not None}
    out: dict[str, tuple[int, int]] = {}
    for tenant_id in {r.tenant_id for r in rows} | {o.tenant_id for o in outcomes}:
        sql = sum(r.billed for r in rows if r.tenant_id == tenant_id)
        received = sum(
            o.billed_as_received
            for o in outcomes
            if o.tenant_id == tenant_id and o.received_all and o.status == 200
        )
        charged = sum(
            r.billed for r in rows if r.tenant_id == tenant_id and r.request_id not in seen
        )
        out[tenant_id] = (sql, received + charged)
    return out


def cache_leaks(outcomes: Sequence[Outcome]) -> list[str]:
    """Cache hits that no earlier request of the same tenant, for the same body, could have
    stored (one tenant answered from another's entry), or whose text differs from it."""
    misses: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        if o.plan.deterministic and o.status == 200 and o.cache not in ("exact", "semantic"):
            misses[(o.tenant_id, _cache_key(o))].append(o)
    problems = []
    for o in outcomes:
        if o.cache not in ("exact", "semantic"):
            continue
        sources = [m for m in misses[(o.tenant_id, _cache_key(o))] if m.started < o.ended]
        if not sources:
            problems.append(f"#{o.plan.index}: a {o.cache} hit no request of its tenant stored")
        elif o.text != sources[0].text:
            problems.append(f"#{o.plan.index}: hit text {o.text!r} != {sources[0].text!r}")
    return problems


def _cache_key(o: Outcome) -> str:
    body = json.loads(o.plan.body)
    body.pop("stream", None)
    body.pop("stream_options", None)
    return json.dumps(body, sort_keys=True)


def statuses(outcomes: Sequence[Outcome]) -> Counter[tuple[str, int | None]]:
    return Counter((o.plan.ending, o.status) for o in outcomes)
