"""An engine that gives no first output (hung: here a real `loramux engine` process stopped with
SIGSTOP) does not hold a request forever: past LORAMUX_ENGINE_FIRST_OUTPUT_SECONDS the client
gets 504 `engine_timeout` (a stream too: its response had not started), and the engine, once
it runs again, aborts the request and holds nothing of it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.engine_process import EngineProcess, engine_process
from tests.gateway.serve_process import wait_for
from tests.gateway.servers import ENGINE_TOKEN, gateway_server
from tests.gateway.tenants import TenantKey, new_tenant

FIRST_OUTPUT_SECONDS = "1"
"""Well inside the channel's heartbeat timeout (5 s), which would end the wait otherwise."""
SETTLE_SECONDS = 60.0


@pytest.fixture
def gateway_and_engine(
    demo_model_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[RunningServer, EngineProcess]]:
    """A gateway configured, as an operator would, with LORAMUX_ENGINE_URLS naming an engine
    process of its own and a short first-output deadline."""
    engine_env = {"LORAMUX_MAX_MODEL_LEN": "512", "LORAMUX_KV_CACHE_MB": "16"}
    with engine_process(demo_model_dir, tmp_path / "engine", ENGINE_TOKEN, engine_env) as engine:
        monkeypatch.setenv("LORAMUX_ENGINE_URLS", engine.url)
        monkeypatch.setenv("LORAMUX_ENGINE_TOKEN", ENGINE_TOKEN)
        monkeypatch.setenv("LORAMUX_ENGINE_FIRST_OUTPUT_SECONDS", FIRST_OUTPUT_SECONDS)
        with gateway_server(demo_model_dir, tmp_path / "gateway", redis_url) as gateway:
            yield gateway, engine


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process `pid` stopped (SIGSTOP) inside the block: alive, answering nothing."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _body(model: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    return {"model": model, "messages": messages, "max_tokens": 8, "stream": stream}


async def _whole_and_streamed(url: str, tenant: TenantKey, model: str) -> list[httpx.Response]:
    """One request answered whole and one streamed, sent together (so the engine stays stopped
    for one deadline, not two)."""
    headers = {"authorization": f"Bearer {tenant.key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        return await asyncio.gather(
            *(client.post("/v1/chat/completions", json=_body(model, s)) for s in (False, True))
        )


def _holds_nothing(engine: EngineProcess, aborted_before: float) -> bool:
    m = engine.metrics()
    held = [m[f"loramux_{k}"] for k in ("num_requests_running", "num_requests_waiting")]
    held.append(m["loramux_kv_cache_usage_perc"])
    return not any(held) and m["loramux_engine_aborted_requests_total"] >= aborted_before + 2


def test_a_request_a_hung_engine_never_starts_gets_504_and_is_aborted_there(
    gateway_and_engine: tuple[RunningServer, EngineProcess],
) -> None:
    gateway, engine = gateway_and_engine
    token = gateway.state.admin.mint("test-admin", ttl_seconds=600)
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {token}"}) as admin:
        tenant = new_tenant(admin, "hung-engine")
    model = gateway.state.model_name
    aborted_before = engine.metrics()["loramux_engine_aborted_requests_total"]

    with stopped(engine.proc.pid):
        answers = asyncio.run(_whole_and_streamed(gateway.url, tenant, model))

    for answer in answers:  # a stream's response starts with its first output: none came
        assert answer.status_code == 504, answer.text
        assert answer.json()["error"]["code"] == "engine_timeout"

    wait_for(
        lambda: _holds_nothing(engine, aborted_before),
        SETTLE_SECONDS,
        "the engine, running again, has aborted both requests and holds nothing of them",
    )
    again = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=_body(model, stream=False),
        headers={"authorization": f"Bearer {tenant.key}"},
        timeout=60,
    )
    assert again.status_code == 200, again.text
