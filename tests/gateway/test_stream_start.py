"""A stream's response starts with its run's first output (its first chunk waits for it
anyway): a run refused before it (the engine down, overloaded or late, a request the engine
refuses) is answered with its error's status, as a whole response is, and billed nothing; a
client that leaves before it is a 499, billed nothing, its request taken out of the engine's
queue at once. Streams that fail after their first output end with an error event
(test_billing)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.service import serve_engine_in_thread
from loramux.gateway.engine_client.remote import RemoteEngineClient
from loramux.gateway.server import RunningServer
from tests.gateway.servers import ENGINE_TOKEN, TcpRelay, gateway_server
from tests.gateway.tenants import TenantKey, new_tenant
from tests.gateway.test_billing import (
    budgeted,
    chat,
    engine_stats,
    headers,
    idle,
    ledger_spent,
    poll,
    usage_events,
)

EOS = 0
"""The demo tokenizer's <|endoftext|>."""


def _admin(gw: RunningServer) -> httpx.Client:
    token = gw.state.admin.mint("test-admin", ttl_seconds=600)
    return httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {token}"}, timeout=60)


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_a_stream_asked_for_while_the_engine_is_down_is_refused_with_503(
    relayed_gateway: tuple[RunningServer, TcpRelay], route: str
) -> None:
    """docs/architecture.md: while the engine is down the gateway answers 503
    `engine_unavailable` at once, a new stream as a whole response: a status its client can
    retry on (the OpenAI SDK retries a 503), counted as a 503. The bug: `200 OK` and an error
    event, the handler having returned the stream before its run reached the engine."""
    gw, relay = relayed_gateway
    with _admin(gw) as admin:
        tenant = budgeted(admin)
    relay.block()  # the engine is unreachable
    body: dict[str, Any] = {"model": gw.state.model_name, "max_tokens": 5}
    if route == "completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    for stream in (False, True):
        r = httpx.post(
            f"{gw.url}/v1/{route}", json=body | {"stream": stream}, headers=headers(tenant)
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
    events = usage_events(gw, tenant, 2)
    assert [(e.status, e.prompt_tokens, e.completion_tokens) for e in events] == [(503, 0, 0)] * 2
    assert ledger_spent(gw, tenant) == 0


@pytest.fixture
def one_seq_gateway(
    demo_model_dir: Path, tmp_path: Path, redis_url: str
) -> Iterator[RunningServer]:
    """A gateway on an engine service (the ZeroMQ channel, as `loramux serve` runs it) that
    runs one sequence at a time, so that a second request waits in the engine's queue."""
    config = EngineConfig(
        model=demo_model_dir, max_model_len=512, kv_cache_bytes=16 << 20, max_num_seqs=1
    )
    engine = AsyncEngine(LLMEngine(config))
    with (
        serve_engine_in_thread(
            engine, "demo", adapter_dir=tmp_path / "adapters", token=ENGINE_TOKEN
        ) as service,
        gateway_server(
            demo_model_dir,
            tmp_path / "data",
            redis_url,
            client=lambda _: RemoteEngineClient([service.url], ENGINE_TOKEN),
        ) as gw,
    ):
        yield gw


def _unread_stream(gw: RunningServer, tenant: TenantKey, body: dict[str, Any]) -> socket.socket:
    """A streamed chat request sent on a raw socket whose answer is never read."""
    raw = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: loramux\r\n"
        f"authorization: Bearer {tenant.key}\r\ncache-control: no-store\r\n"
        f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
    )
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + raw)
    return sock


def test_a_stream_whose_client_leaves_while_queued_in_the_engine_is_billed_nothing(
    one_seq_gateway: RunningServer,
) -> None:
    """README: a client that closes the connection stops generation at once, and a request
    that generated nothing is charged nothing. Here the request waits in the engine's queue
    behind another when its client leaves: it leaves the queue at once, is never computed, and
    is a 499 billed nothing. The bug: the remote engine client only aborted it at its first
    output, so the engine computed it for nobody, and its client was billed."""
    gw = one_seq_gateway
    with _admin(gw) as admin:
        tenant, other = budgeted(admin), new_tenant(admin, "blocker")
    idle(gw)
    blocker = chat(stream=True) | {"model": gw.state.model_name, "max_tokens": 490}
    blocker |= {"logit_bias": {str(EOS): -100}}  # it runs to its end
    running = _unread_stream(gw, other, blocker)
    poll("the blocker to run", lambda: engine_stats(gw).running == 1)
    queued = _unread_stream(gw, tenant, blocker | {"max_tokens": 8})
    poll("the request to wait in the engine", lambda: engine_stats(gw).waiting == 1)
    queued.close()
    poll("the request to leave the engine's queue", lambda: engine_stats(gw).waiting == 0)
    assert engine_stats(gw).running == 1  # the blocker still runs: the abort emptied the queue
    running.close()
    idle(gw)
    events = usage_events(gw, tenant, 1)
    assert [(e.status, e.prompt_tokens, e.completion_tokens) for e in events] == [(499, 0, 0)]
    assert ledger_spent(gw, tenant) == 0
