"""One tenant filling the engine's queue does not lock other tenants out: the gateway names each
request's tenant to the engine (`EngineRequest.owner`), and a full queue takes another
tenant's request in place of the flooder's newest queued one, which gets the 503
`engine_overloaded` it would have got had it come last (engine.queue_share). Through the real
gateway and its in-process engine, sized by LORAMUX_MAX_NUM_SEQS and LORAMUX_MAX_WAITING."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.demo_model import EOS_TOKEN_IDS
from loramux.gateway.db import UsageEvent
from loramux.gateway.engine_client.local import LocalEngineClient
from loramux.gateway.server import RunningServer
from loramux.gateway.settings import Settings
from tests.gateway.serve_process import wait_for
from tests.gateway.servers import gateway_server
from tests.gateway.tenants import TenantKey, new_tenant

MAX_NUM_SEQS, MAX_WAITING = 1, 2


@dataclass
class Gateway:
    server: RunningServer
    engine: AsyncEngine = field(init=False)


@pytest.fixture
def small_gateway(
    demo_model_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Gateway]:
    """A gateway whose engine runs one request and queues two more (set by the variables)."""
    monkeypatch.setenv("LORAMUX_MAX_NUM_SEQS", str(MAX_NUM_SEQS))
    monkeypatch.setenv("LORAMUX_MAX_WAITING", str(MAX_WAITING))
    engines: list[AsyncEngine] = []

    def client(settings: Settings) -> LocalEngineClient:
        engines.append(AsyncEngine.from_config(settings.engine.engine_config(demo_model_dir)))
        return LocalEngineClient(engines[-1], settings.model_name)

    with gateway_server(demo_model_dir, tmp_path / "gw", redis_url, client=client) as server:
        gateway = Gateway(server)
        gateway.engine = engines[0]
        yield gateway


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "logit_bias": {str(t): -100 for t in EOS_TOKEN_IDS},
        "stream": stream,
    }


def _stream_outcome(url: str, key: str) -> str:
    """A streamed request read to its end: `done`, or the code of the error ending it (its
    refusal before its first output, or the error event ending it after)."""
    with (
        httpx.Client(base_url=url, timeout=120) as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            json=_body(160, stream=True),
            headers={"authorization": f"Bearer {key}"},
        ) as r,
    ):
        if r.status_code != 200:
            return str(json.loads(r.read())["error"]["code"])
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return "done"
            if line.startswith("data: ") and "error" in (event := json.loads(line[6:])):
                return str(event["error"]["code"])
    return "cut"


def _post(url: str, tenant: TenantKey) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json=_body(8, stream=False),
        headers={"authorization": f"Bearer {tenant.key}"},
        timeout=120,
    )


def test_a_tenant_filling_the_engine_queue_gives_way_to_another_tenant(
    small_gateway: Gateway,
) -> None:
    """The flooder holds every place (one running, two queued): its own next request is refused
    at once, as before; another tenant's is served, and the flooder's newest queued stream is
    refused with the `engine_overloaded` 503 instead (it had no output: its response had not
    started), billed nothing and recorded as a 503."""
    server, engine = small_gateway.server, small_gateway.engine
    token = server.state.admin.mint("queue-share-admin", ttl_seconds=600)
    with httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {token}"}, timeout=60
    ) as admin:
        flooder, victim = new_tenant(admin, "flood"), new_tenant(admin, "victim")
    outcomes: list[str] = []

    def hold() -> None:
        outcomes.append(_stream_outcome(server.url, flooder.key))

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    places = MAX_NUM_SEQS + MAX_WAITING
    wait_for(
        lambda: engine.stats().running + engine.stats().waiting == places,
        30,
        "the flooder holds every place of the engine's queue",
    )

    own = _post(server.url, flooder)
    assert own.status_code == 503 and own.json()["error"]["code"] == "engine_overloaded"
    served = _post(server.url, victim)
    assert served.status_code == 200, served.text
    for t in threads:
        t.join(120)
    assert sorted(outcomes) == ["done", "done", "engine_overloaded"]

    def statuses() -> list[tuple[int, int]]:
        async def read() -> list[tuple[int, int]]:
            await server.state.usage.flush()
            async with server.state.sessions() as session:
                query = select(UsageEvent).where(UsageEvent.tenant_id == flooder.tenant_id)
                return sorted((e.status, e.completion_tokens) for e in await session.scalars(query))

        events: list[tuple[int, int]] = server.run(read())
        return events

    wait_for(lambda: len(statuses()) == 4, 30, "every flooder request is recorded")
    assert statuses() == [(200, 160), (200, 160), (503, 0), (503, 0)]
    wait_for(lambda: engine.stats().kv_blocks_used == 0, 30, "every block is free again")
