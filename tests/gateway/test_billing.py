"""Every token the engine generates is billed, whatever the client does: it reads to the end,
closes a stream midway, closes the connection of a non-streamed request, or the request fails
after generation started. The usage event and the token-budget ledger agree with what the
engine generated, and a client that leaves stops the engine's work at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from litestar.exceptions import LitestarException
from sqlalchemy import select

from loramux.engine.outputs import EngineStats
from loramux.gateway.db import UsageEvent
from loramux.gateway.quotas.buckets import budget_period, scope_prefix
from loramux.gateway.server import RunningServer
from tests.gateway.servers import TcpRelay
from tests.gateway.tenants import TenantKey, new_tenant

MAX_TOKENS = 400
DEADLINE_SECONDS = 30
UPLOAD_SECONDS = 0.3


def chat(stream: bool) -> dict[str, Any]:
    return {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "Write a long story about a compiler."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }


def headers(tenant: TenantKey) -> dict[str, str]:
    return {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}


def budgeted(admin: httpx.Client) -> TenantKey:
    """A new tenant with a monthly token budget (so it has a ledger) it will not reach."""
    tenant = new_tenant(admin, "billing")
    quota = {"token_budget": 10_000_000, "budget_period": "month"}
    r = admin.put(f"/admin/tenants/{tenant.tenant_id}/quotas", json=quota)
    assert r.status_code == 200, r.text
    return tenant


def poll(what: str, check: Any) -> Any:
    """`check()` once it returns something truthy; fails after DEADLINE_SECONDS."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return result


def engine_stats(gateway: RunningServer) -> EngineStats:
    [stats] = gateway.run(gateway.state.engine.stats())
    return stats


def idle(gateway: RunningServer) -> EngineStats:
    """The engine's stats once nothing runs or waits and every KV block is free."""

    def check() -> EngineStats | None:
        s = engine_stats(gateway)
        return s if s.running == s.waiting == s.kv_blocks_used == 0 else None

    result: EngineStats = poll("the engine to be idle", check)
    return result


def usage_events(gateway: RunningServer, tenant: TenantKey, count: int) -> list[UsageEvent]:
    async def read() -> list[UsageEvent]:
        await gateway.state.usage.flush()
        async with gateway.state.sessions() as session:
            query = select(UsageEvent).where(UsageEvent.tenant_id == tenant.tenant_id)
            return list(await session.scalars(query))

    def check() -> list[UsageEvent] | None:
        events = gateway.run(read())
        return events if len(events) >= count else None

    events: list[UsageEvent] = poll(f"{count} usage events", check)
    assert len(events) == count
    return events


def _ledger(tenant: TenantKey) -> bytes:
    month = budget_period("month", datetime.now(UTC))
    return f"{scope_prefix(tenant.tenant_id, None)}:budget:{month.name}".encode()


def ledger_spent(gateway: RunningServer, tenant: TenantKey) -> int:
    """Tokens the tenant's budget ledger has charged, once no reservation is left open."""
    ledger = _ledger(tenant)

    def check() -> dict[bytes, bytes] | None:
        fields = gateway.run(gateway.state.redis.hgetall(ledger))
        return fields if set(fields) == {b"spent"} else None  # every request settled

    return int(poll("the ledger to settle", check)[b"spent"])


def billed(events: list[UsageEvent]) -> int:
    return sum(e.prompt_tokens + e.completion_tokens for e in events)


def test_a_finished_request_is_billed_for_its_usage(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = budgeted(admin)
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=chat(stream=False) | {"max_tokens": 8},
        headers=headers(tenant),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    [event] = usage_events(gateway, tenant, 1)
    usage = r.json()["usage"]
    assert (event.status, event.prompt_tokens, event.completion_tokens) == (
        200,
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert ledger_spent(gateway, tenant) == usage["total_tokens"]


STOPPED_OVERSHOOT = 8
"""Tokens a choice may still generate after its stop string matched, before its abort lands
(a step or two; more on a loaded machine)."""


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_ended_by_a_stop_string_is_aborted_in_the_engine_at_once(
    gateway: RunningServer, admin: httpx.Client, stream: bool
) -> None:
    """n = 16 choices, each ending at a stop string at its own time: each choice's engine
    sequence is aborted when its stop string matches, not when the last choice ends. (Choices
    ran on until then: 816 tokens generated for 276 billed, engine work nobody paid for.)"""
    tenant = new_tenant(admin, "stops")
    before = idle(gateway)
    body = {"model": "demo-model", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS}
    body |= {"n": 16, "temperature": 1, "seed": 3, "stop": ["q", "z", "x"], "stream": stream}
    with httpx.stream(
        "POST", f"{gateway.url}/v1/completions", json=body, headers=headers(tenant), timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        r.read()
    [event] = usage_events(gateway, tenant, 1)
    generated = idle(gateway).generated_tokens - before.generated_tokens
    assert event.completion_tokens <= generated <= event.completion_tokens + 16 * STOPPED_OVERSHOOT


def test_latency_and_time_to_first_token_count_from_the_requests_arrival(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """As its client sees them: the body's upload, authentication, tokenizing, admission and
    the cache lookup included, not only the engine's part."""
    tenant = new_tenant(admin, "arrival")
    body = json.dumps(chat(stream=True) | {"max_tokens": 4}).encode()

    def slow_body() -> Iterator[bytes]:
        time.sleep(UPLOAD_SECONDS)  # the headers are sent: the request has arrived
        yield body

    started = time.perf_counter()
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        content=slow_body(),
        headers=headers(tenant) | {"content-type": "application/json"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
    elapsed_ms = (time.perf_counter() - started) * 1000
    [event] = usage_events(gateway, tenant, 1)
    assert event.ttft_ms is not None
    assert UPLOAD_SECONDS * 1000 <= event.ttft_ms <= event.latency_ms <= elapsed_ms


def test_a_paced_cache_hits_time_to_first_token_is_its_first_pieces(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """A paced hit sends its first piece at once and the rest a gap apart: its time to first
    token is when that first piece went, not the replay's end, whether its client reads to the
    end or leaves after the first piece (a 499 that keeps its time to first token, as a run's
    does)."""
    tenant = new_tenant(admin, "paced")
    pacing = {"hit_pacing": "paced", "hit_tokens_per_second": 10}
    assert admin.put(f"/admin/tenants/{tenant.tenant_id}/cache", json=pacing).status_code == 200
    question = chat(stream=False) | {"max_tokens": 8}
    auth = {"authorization": f"Bearer {tenant.key}"}
    url = f"{gateway.url}/v1/chat/completions"
    miss = httpx.post(url, json=question, headers=auth, timeout=60).json()
    pieces = min(miss["usage"]["completion_tokens"], len(miss["choices"][0]["message"]["content"]))
    assert pieces >= 4
    for leave in (False, True):
        with httpx.stream("POST", url, json=question | {"stream": True}, headers=auth) as r:
            assert r.headers["x-cache"] == "exact"
            for line in r.iter_lines():
                if leave and line.startswith("data: {") and '"content"' in line:
                    break  # its first piece, of text
    events = [e for e in usage_events(gateway, tenant, 3) if e.cache == "exact"]
    read, left = sorted(events, key=lambda e: e.status)
    assert (read.status, left.status) == (200, 499)
    assert read.ttft_ms is not None and left.ttft_ms is not None
    # The pieces after the first were sent at least a gap (100 ms) apart, after its first.
    assert read.latency_ms - read.ttft_ms >= (pieces - 2) * 100
    assert left.ttft_ms <= left.latency_ms


def test_a_stream_closed_midway_is_billed_for_every_token_generated(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = budgeted(admin)
    before = idle(gateway)
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json=chat(stream=True),
        headers=headers(tenant),
        timeout=60,
    ) as r:
        assert r.status_code == 200
        data = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(20):
            next(data)
    after = idle(gateway)
    [event] = usage_events(gateway, tenant, 1)
    generated = after.generated_tokens - before.generated_tokens
    assert event.status == 499
    assert 19 <= event.completion_tokens == generated < MAX_TOKENS
    assert event.prompt_tokens > 0
    assert ledger_spent(gateway, tenant) == billed([event])


class ConnectionBroke(OSError):
    """What a server's `send` raises once the client's connection is gone."""


def request_broken_at_start(
    gateway: RunningServer, body: dict[str, Any], headers: dict[str, str]
) -> list[dict[str, Any]]:
    """Sends a request straight to the gateway's ASGI app, whose connection breaks at the
    response's first message (`send` raises), as a client gone when the response starts would
    make it; returns the messages the app sent."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"loramux"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            *((k.encode(), v.encode()) for k, v in headers.items()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the connection stays open as far as reading goes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start" and message["status"] == 200:
            raise ConnectionBroke("the client's connection is gone")

    async def request() -> None:
        # Litestar re-raises it, wrapped once the response has started.
        with contextlib.suppress(ConnectionBroke, LitestarException):
            await gateway.server.config.loaded_app(scope, receive, send)

    gateway.run(request())
    return sent


def test_a_stream_whose_response_never_starts_is_aborted_and_billed(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """The engine gets a request before its response starts (gateway.openai.routes). Here the
    connection breaks at the response's first message, so its stream is never read: the run is
    aborted all the same, and billed for what the engine generated, as for any client that
    left."""
    tenant = budgeted(admin)
    before = idle(gateway)
    sent = request_broken_at_start(gateway, chat(stream=True), headers(tenant))
    assert [m["type"] for m in sent] == ["http.response.start"]  # not a byte of the stream
    after = idle(gateway)
    [event] = usage_events(gateway, tenant, 1)
    generated = after.generated_tokens - before.generated_tokens
    assert event.status == 499
    assert event.completion_tokens == generated < MAX_TOKENS  # aborted, not run to its end
    assert ledger_spent(gateway, tenant) == billed([event])


def test_a_streamed_cache_hit_whose_response_never_starts_is_metered_and_settled(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """A cache hit has no run to abort, and its stream, never read, never replays: its response's
    end meters it (a 499, billed nothing) and settles its reservation all the same."""
    tenant = new_tenant(admin, "billing")
    quota = {"max_concurrent": 1, "token_budget": 10_000_000, "budget_period": "month"}
    assert admin.put(f"/admin/tenants/{tenant.tenant_id}/quotas", json=quota).status_code == 200
    question = chat(stream=False) | {"max_tokens": 8}
    auth = {"authorization": f"Bearer {tenant.key}"}
    url = f"{gateway.url}/v1/chat/completions"
    first = httpx.post(url, json=question, headers=auth, timeout=60)
    assert (first.status_code, first.headers["x-cache"]) == (200, "miss")

    sent = request_broken_at_start(gateway, question | {"stream": True}, auth)
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert (b"x-cache", b"exact") in sent[0]["headers"]
    # Its concurrency slot, the tenant's only one, was freed when its response ended.
    after = httpx.post(url, json=question, headers=auth, timeout=60)
    assert after.status_code == 200, after.text
    events = usage_events(gateway, tenant, 3)
    outcomes = sorted((e.status, e.cache, e.prompt_tokens + e.completion_tokens) for e in events)
    assert outcomes == [(200, "exact", 0), (200, "miss", billed(events)), (499, "exact", 0)]
    assert ledger_spent(gateway, tenant) == billed(events)


def _open_request(
    gateway: RunningServer, tenant: TenantKey, body_bytes: int | None = None
) -> socket.socket:
    """A non-streamed request sent on a raw socket whose answer is never read; only its body's
    first `body_bytes` when given."""
    body = json.dumps(chat(stream=False)).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: loramux\r\n"
        f"authorization: Bearer {tenant.key}\r\ncache-control: no-store\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    host, port = gateway.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + body[:body_bytes])
    return sock


def test_a_client_that_leaves_before_its_whole_body_is_a_499_billed_nothing(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """Not a server error: a client must not be able to raise the gateway's 5xx count (alerts,
    error budgets, the tenant's dashboard) by hanging up mid-body."""
    tenant = budgeted(admin)
    before = idle(gateway)
    for body_bytes in (0, 10):
        _open_request(gateway, tenant, body_bytes).close()
    events = usage_events(gateway, tenant, 2)
    assert [(e.status, e.prompt_tokens, e.completion_tokens) for e in events] == [(499, 0, 0)] * 2
    assert idle(gateway).generated_tokens == before.generated_tokens
    assert _ledger(tenant) not in gateway.run(gateway.state.redis.keys("*:budget:*"))


def test_non_streamed_requests_whose_clients_leave_are_aborted_and_billed(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = budgeted(admin)
    before = idle(gateway)
    sockets = [_open_request(gateway, tenant) for _ in range(4)]
    poll(
        "every request to be generating",
        lambda: engine_stats(gateway).generated_tokens >= before.generated_tokens + 3 * 4,
    )
    for sock in sockets:
        sock.close()
    after = idle(gateway)
    events = usage_events(gateway, tenant, 4)
    assert {e.status for e in events} == {499}
    assert all(e.completion_tokens < MAX_TOKENS for e in events)
    assert sum(e.completion_tokens for e in events) == after.generated_tokens - (
        before.generated_tokens
    )
    assert ledger_spent(gateway, tenant) == billed(events)


def test_a_request_that_fails_after_generation_started_is_billed_for_what_it_received(
    relayed_gateway: tuple[RunningServer, TcpRelay],
) -> None:
    gw, relay = relayed_gateway
    token = gw.state.admin.mint("test-admin", ttl_seconds=600)
    with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {token}"}) as admin:
        tenant = budgeted(admin)
    body = chat(stream=True) | {"model": gw.state.model_name}
    with httpx.stream(
        "POST", f"{gw.url}/v1/chat/completions", json=body, headers=headers(tenant)
    ) as r:
        events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
        received = [next(events) for _ in range(10)]
        relay.cut()
        received += list(events)
    assert received[-1]["error"]["code"] == "engine_unavailable"
    [event] = usage_events(gw, tenant, 1)
    assert event.status == 503
    assert len(received) - 2 <= event.completion_tokens < MAX_TOKENS
    assert event.prompt_tokens > 0
    assert ledger_spent(gw, tenant) == billed([event])
