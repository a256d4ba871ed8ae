"""Liveness (/health) against the in-thread gateway: what it says while all is well, and that it
fails once a child process serve supervises keeps dying."""

from __future__ import annotations

import os

import httpx

from loramux.gateway.server import RunningServer
from loramux.gateway.supervisor import FAILING_EXITS, ChildSpec, SupervisedChild, Supervisor
from tests.gateway.serve_process import wait_for


async def _ready() -> bool:
    return True


def test_health_says_ok_and_engine_up(gateway: RunningServer) -> None:
    r = httpx.get(f"{gateway.url}/health", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "engine": "up", "pid": os.getpid()}  # served in-thread


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
