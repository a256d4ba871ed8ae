"""Liveness (/health) against the in-thread gateway: what it says while all is well, while one
engine of several is down, and that it fails once a child process serve supervises keeps dying;
readiness (/ready) while the database does not answer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import make_url

from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.health import READY_PROBE_SECONDS
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import EngineSettings, ServerSettings, Settings
from loramux.gateway.supervisor import FAILING_EXITS, ChildSpec, SupervisedChild, Supervisor
from tests.gateway.conftest import admin_client
from tests.gateway.serve_process import wait_for
from tests.gateway.servers import ENGINE_TOKEN, TcpRelay, engine_service, gateway_server
from tests.gateway.tenants import new_tenant
from tests.migrations.test_revisions import new_postgres_database


async def _ready() -> bool:
    return True


def test_health_says_ok_and_engine_up(gateway: RunningServer) -> None:
    r = httpx.get(f"{gateway.url}/health", timeout=10)
    assert r.status_code == 200
    body = {"status": "ok", "engine": "up", "engines": ["up"], "pid": os.getpid()}  # in-thread
    assert r.json() == body


def test_health_says_degraded_and_which_engine_is_down_while_one_of_several_is(
    two_engine_gateway: tuple[list[RunningEngineService], RunningServer],
) -> None:
    """Engine #0 of two down for good. Bug: /health said `ok`, engine `up` (it asked whether
    any engine answers), while README says such an engine makes it say `degraded`. Now it says
    so and which engine is down; /ready stays 200, as the other engine serves."""
    engines, gw = two_engine_gateway

    def health() -> dict:
        response = httpx.get(f"{gw.url}/health", timeout=30)
        assert response.status_code == 200
        return dict(response.json())

    assert health()["engines"] == ["up", "up"]
    engines[0].stop()
    wait_for(lambda: health()["engines"] == ["down", "up"], 30, "/health names engine #0 down")
    assert health()["status"] == "degraded" and health()["engine"] == "degraded"
    assert httpx.get(f"{gw.url}/ready", timeout=30).status_code == 200
    engines[1].stop()
    wait_for(lambda: health()["engine"] == "down", 30, "/health says every engine is down")
    assert health()["engines"] == ["down", "down"] and health()["status"] == "degraded"


def test_health_and_ready_say_an_engine_whose_step_loop_failed_is_down(
    demo_model_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An external engine whose step thread failed (a device error) refuses every request and
    its own /health says `stopped`. Bug: the gateway asked it only for stats, which its event
    loop still answered, so /health said engine `up` and /ready 200, and a load balancer kept
    sending traffic that all failed. The engine now refuses stats while it serves nothing."""
    with engine_service(demo_model_dir, tmp_path / "adapters") as service:
        monkeypatch.setenv("LORAMUX_ENGINE_URLS", service.url)
        monkeypatch.setenv("LORAMUX_ENGINE_TOKEN", ENGINE_TOKEN)
        with gateway_server(demo_model_dir, tmp_path / "gw", redis_url) as gw:
            with admin_client(gw) as admin:
                tenant = new_tenant(admin, "health")

            def health() -> dict[str, Any]:
                return dict(httpx.get(f"{gw.url}/health", timeout=30).json())

            assert health()["engines"] == ["up"]

            def device_lost() -> Any:
                raise RuntimeError("device lost")

            monkeypatch.setattr(service.engine.engine, "step", device_lost)
            body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
            auth = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
            assert r.status_code == 503, r.text
            assert httpx.get(f"{service.health_url}/health").json() == {"status": "stopped"}
            wait_for(lambda: health()["engines"] == ["down"], 30, "/health says the engine is down")
            assert (health()["status"], health()["engine"]) == ("degraded", "down")
            assert httpx.get(f"{gw.url}/ready", timeout=30).status_code == 503


def test_health_fails_once_a_supervised_child_keeps_dying(gateway: RunningServer) -> None:
    supervisor = Supervisor()

    async def start() -> SupervisedChild:
        child = supervisor.spawn(ChildSpec("flaky", ("sh", "-c", "sleep 0.1; exit 1"), _ready, 30))
        await child.started()
        return child

    async def stop() -> None:
        supervisor.stop_all()

    gateway.run(start())
    gateway.state.children = supervisor
    try:
        answers: list[httpx.Response] = []

        def failing() -> bool:
            answers.append(httpx.get(f"{gateway.url}/health", timeout=10))
            if answers[-1].status_code == 200:
                assert answers[-1].json()["status"] in ("ok", "degraded"), answers[-1].json()
            return answers[-1].status_code != 200

        wait_for(failing, 60, f"/health fails after {FAILING_EXITS} exits")
        r = answers[-1]
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "failing" and body["engine"] == "up"
        flaky = body["children"]["flaky"]
        assert flaky["failing"] and flaky["last_exit"] == "exited with status 1"
    finally:
        gateway.state.children = None
        gateway.run(stop())


def test_ready_answers_503_while_the_database_does_not_answer(
    demo_model_dir: Path, tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    """A database behind a network that drops packets (connections open, nothing comes back):
    its SELECT 1 never ends, and every /ready waited on it."""
    url = new_postgres_database(postgres_url)
    upgrade(url)
    relay = TcpRelay(make_url(url).port or 5432)
    through_relay = make_url(url).set(port=relay.port).render_as_string(hide_password=False)
    settings = Settings(
        data_dir=tmp_path / "gw",
        model=demo_model_dir,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=32),
        server=ServerSettings(database_url=through_relay, model_name="demo-model"),
    )
    client = engine_client(settings, demo_model_dir)
    with serve_in_thread(settings, client, demo_model_dir, redis_url=redis_url) as gw:
        assert httpx.get(f"{gw.url}/ready", timeout=30).status_code == 200
        relay.stall()
        answers: list[httpx.Response] = []

        def not_ready() -> bool:
            try:
                answers.append(httpx.get(f"{gw.url}/ready", timeout=READY_PROBE_SECONDS * 4))
            except httpx.ReadTimeout:
                raise AssertionError("/ready waits on a database that does not answer") from None
            return answers[-1].status_code == 503

        try:
            wait_for(not_ready, 60, "/ready says the database does not answer")
            assert answers[-1].json()["checks"] == {
                "database": False,
                "engine": True,
                "redis": True,
            }
        finally:
            relay.flow()
            relay.close()
