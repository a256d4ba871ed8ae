"""The engine, run as its own `loramux engine` process behind LORAMUX_ENGINE_URLS, killed with
SIGKILL under load and started again.

While it is gone every request ends promptly with a clean 503 (at the head, or as an error event
inside a stream already under way), never a hang and never another error; once it is back
(without the adapters it held: the gateway gives them again), requests are served again, every
request answered before is billed once, and nothing stays reserved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.servers import demo_env
from tests.postgres import free_port
from tests.reliability import books
from tests.reliability.rig import (
    TenantsDrill,
    admin_client,
    drill,
    gateway_settings,
    make_tenants,
    serve,
    unanswered,
)
from tests.reliability.traffic import Mix, plan_requests

REPOSITORY = Path(__file__).resolve().parents[2]
TOKEN = "reliability-engine-token"
ENGINE_CODES = {"engine_unavailable", "engine_overloaded"}
FAULT_MIX = Mix(disconnect=0.0, cancel=0.0, bad=0.0, max_tokens=(4, 12))
"""Longer answers than the soak's, so streams are under way when the engine dies."""


class EngineProcess:
    """`loramux engine` in a process group of its own, at one address across restarts."""

    def __init__(self, model_dir: Path, data_dir: Path):
        self.port, self.health_port = free_port(), free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.log = data_dir / "engine.log"
        self.env = os.environ | demo_env(
            model_dir,
            LORAMUX_DATA_DIR=str(data_dir),
            LORAMUX_ENGINE_TOKEN=TOKEN,
            PYTHONPATH=os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")]),
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and return once it answers /health (a minute at most)."""
        command = [sys.executable, "-m", "loramux.gateway.cli", "engine", "--address", self.url]
        command += ["--health-port", str(self.health_port)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=log, start_new_session=True
            )
        for _ in range(1200):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if (
                    httpx.get(f"http://127.0.0.1:{self.health_port}/health", timeout=1).status_code
                    == 200
                ):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"the engine did not start:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL to its whole process group: no shutdown of any kind."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture(scope="module")
def engine_process(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    engine = EngineProcess(demo_model_dir, tmp_path_factory.mktemp("engine-process"))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def remote_gateway(
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    engine_process: EngineProcess,
) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("remote-engine-gateway")
    settings = gateway_settings(
        demo_model_dir, data, engine_urls=(engine_process.url,), engine_token=TOKEN
    )
    with serve(settings, redis_url) as server:
        yield server


@pytest.fixture(scope="module")
async def killed(
    remote_gateway: RunningServer, engine_process: EngineProcess, adapter_dirs: list[Path]
) -> TenantsDrill:
    with admin_client(remote_gateway) as admin:
        tenants = make_tenants(admin, 2, adapter_dirs)
    d = await drill(
        remote_gateway,
        tenants,
        plan_requests(None, len(tenants), FAULT_MIX, seed=21),
        fault=engine_process.kill,
        outage_seen=unanswered(8),
        recover=engine_process.start,
    )
    return TenantsDrill(d, tenants)


def test_the_outage_is_seen_and_service_comes_back(killed: TenantsDrill) -> None:
    assert killed.drill.outage_seen
    assert killed.drill.recovery_seen


def test_requests_fail_only_with_a_clean_503(killed: TenantsDrill) -> None:
    assert books.unclean_failures(killed.drill.run.outcomes, ENGINE_CODES) == []


def test_streams_under_way_end_with_an_error_event_and_no_done(killed: TenantsDrill) -> None:
    cut = [o for o in killed.drill.run.outcomes if o.stream_error is not None]
    assert all(not o.done and o.status == 200 for o in cut)


def test_every_answered_request_is_billed_once(
    killed: TenantsDrill, remote_gateway: RunningServer
) -> None:
    rows = remote_gateway.run(books.stored_usage(remote_gateway, killed.tenants))
    assert books.unbilled(killed.drill.run.outcomes, rows) == []


async def test_nothing_stays_held_in_the_new_engine_or_in_redis(
    killed: TenantsDrill, remote_gateway: RunningServer, redis_url: str
) -> None:
    left = await books.settled_residue(remote_gateway, redis_url, killed.tenants)
    assert (left.running, left.waiting, left.kv_blocks_used) == (0, 0, 0)
    assert left.open_reservations == {}
