"""Stopping `loramux serve` loses no usage (billing): every request that reached the engine is one
usage event, whether it finished within the grace period, was cut at its end, or was cut by a
second signal; with one gateway process or several."""

from __future__ import annotations

import re
import signal
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loramux.gateway.auth.admin_jwt import AdminAuth
from loramux.gateway.serve import CLOSE_SECONDS
from loramux.gateway.state import RUNS_END_SECONDS, USAGE_CLOSE_SECONDS
from tests.gateway.serve_process import Serve, command_line, serve, wait_for
from tests.gateway.servers import demo_env
from tests.gateway.tenants import TenantKey, new_tenant

SECRET = "stop-usage-test-secret-" + "x" * 32
STREAMS = 12
"""Long streams in flight at the stop: the engine runs one at a time, the others wait in its
queue, so that most are cut wherever they were."""


@pytest.fixture(scope="module")
def env(demo_model_dir: Path) -> dict[str, str]:
    return demo_env(
        demo_model_dir,
        LORAMUX_ADMIN_SECRET=SECRET,
        LORAMUX_DEMO_ADAPTERS="0",
        LORAMUX_MAX_NUM_SEQS="1",
        LORAMUX_ENGINE_THREADS="1",
    )


def _tenant(running: Serve) -> TenantKey:
    token = AdminAuth(SECRET).mint("stop-usage-test")
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=running.url, headers=headers, timeout=60) as admin:
        return new_tenant(admin, "stop")


def _stream(url: str, key: str) -> str:
    """How one long chat stream ended: `done`, `cut` (its connection closed before the end,
    with or without an error event, or before its response began) or `unstarted` (its run
    ended before its first output, stopped with the gateway: answered with an error status)."""
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 480,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    try:
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
        ) as r:
            if r.status_code != 200:
                return "unstarted"
            last = ""
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = line.removeprefix("data: ")
        return "done" if last == "[DONE]" else "cut"
    except httpx.HTTPError:
        return "cut"


def _stop_with_streams_in_flight(running: Serve, *signals: signal.Signals) -> list[str]:
    """Start STREAMS streams, send `signals` once every one is under way (the others once serve
    logged the first), and return how each ended; serve exits 0 having written the usage of
    every stream."""
    tenant = _tenant(running)
    with ThreadPoolExecutor(STREAMS) as pool:
        streams = [pool.submit(_stream, running.url, tenant.key) for _ in range(STREAMS)]
        # A stream's response begins with its first output: those queued behind the one the
        # engine runs have none yet, but are in the engine.
        wait_for(lambda: _in_engine(running) == STREAMS, 120, "every stream is in the engine")
        first, *again = signals
        running.proc.send_signal(first)
        wait_for(lambda: f"received {first.name}" in running.output(), 30, "serve is stopping")
        for sig in again:
            running.proc.send_signal(sig)
        assert running.proc.wait(timeout=120) == 0, running.output()
        ends = [s.result(timeout=60) for s in streams]
    rows = _usage_rows(running.data_dir, tenant.tenant_id)
    assert len(rows) == STREAMS, (ends, rows, running.output())
    return ends


def _in_engine(running: Serve) -> int:
    """Requests the engine child runs or queues (its /metrics; the health port is on its
    command line)."""
    cmd = command_line(running.child(" engine "))
    port = re.search(r"--health-port (\d+)", cmd)
    assert port is not None, cmd
    text = httpx.get(f"http://127.0.0.1:{port[1]}/metrics", timeout=10).text
    held = ("loramux_num_requests_running", "loramux_num_requests_waiting")
    return sum(int(float(line.split()[1])) for line in text.splitlines() if line.startswith(held))


def _usage_rows(data_dir: Path, tenant_id: str) -> list[tuple[int, int]]:
    """(status, completion tokens) of each usage event of the tenant, as serve left them."""
    db = sqlite3.connect(data_dir / "loramux.db")
    try:
        return db.execute(
            "SELECT status, completion_tokens FROM usage_events WHERE tenant_id = ?",
            (tenant_id,),
        ).fetchall()
    finally:
        db.close()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_sigint_cuts_the_requests_and_still_writes_their_usage(
    env: dict[str, str], tmp_path: Path, workers: str
) -> None:
    """uvicorn skips its lifespan shutdown on a forced exit: the gateway never closed, so the
    usage it held (its recorder flushes every 0.5 s) and that of the requests cut was lost.
    The grace period is long: the requests end because the second signal cut them. With
    --workers 2 the second signal reached serve alone (its workers run in sessions of their
    own), which had no HTTP server to force: its workers waited out the grace period."""
    long = env | {"LORAMUX_STOP_GRACE_SECONDS": "600"}
    with serve(tmp_path, long, args=("--workers", workers)) as running:
        ends = _stop_with_streams_in_flight(running, signal.SIGINT, signal.SIGINT)
    assert "cut" in ends, ends


@pytest.mark.parametrize("workers", ["1", "2"])
def test_requests_cut_at_the_end_of_the_grace_period_still_write_their_usage(
    env: dict[str, str], tmp_path: Path, workers: str
) -> None:
    """The HTTP server cancels the requests still running when the grace period ends and shuts
    the gateway down at once; their engine runs end (aborted) a moment later, and were metered
    after the usage recorder had flushed for the last time: never written, and not a word said.
    With --workers 2, serve killed each worker when its grace period ended, before its close."""
    short = env | {"LORAMUX_STOP_GRACE_SECONDS": "1"}
    with serve(tmp_path, short, args=("--workers", workers)) as running:
        ends = _stop_with_streams_in_flight(running, signal.SIGTERM)
    assert "cut" in ends, ends


def test_serve_gives_a_worker_the_time_its_close_may_take_after_the_grace_period() -> None:
    """A gateway's close waits for the runs it cut, then for the database to take its usage;
    serve kills a worker still closing after CLOSE_SECONDS (its connections close too)."""
    assert RUNS_END_SECONDS + USAGE_CLOSE_SECONDS < CLOSE_SECONDS
