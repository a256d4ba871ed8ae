"""`loramux engine` as a real subprocess for tests, on a tcp:// address, killed as a process
group however the test ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.gateway.serve_process import START_SECONDS, free_port, wait_for


@dataclass(frozen=True)
class EngineProcess:
    proc: subprocess.Popen[bytes]
    url: str
    """Where gateways connect (tcp://)."""
    health_url: str
    log: Path

    def metrics(self) -> dict[str, float]:
        """The engine's /metrics, by metric name."""
        text = httpx.get(f"{self.health_url}/metrics", timeout=10).text
        pairs = (line.split() for line in text.splitlines() if not line.startswith("#"))
        return {name: float(value) for name, value in pairs}


@contextlib.contextmanager
def engine_process(
    model_dir: Path, data_dir: Path, token: str, env: dict[str, str]
) -> Iterator[EngineProcess]:
    """Start `loramux engine` over `model_dir` with `env` on top of ours; yield it once its
    /health answers."""
    port, health_port = free_port(), free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "engine.log"
    command = [sys.executable, "-m", "loramux.gateway.cli", "engine", "--address"]
    command += [f"tcp://127.0.0.1:{port}", "--health-port", str(health_port)]
    settings = {
        "LORAMUX_MODEL": str(model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_DATA_DIR": str(data_dir),
        "LORAMUX_ENGINE_TOKEN": token,
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            env=os.environ | settings | env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    running = EngineProcess(proc, f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{health_port}", log)
    try:
        wait_for(lambda: _healthy(running), START_SECONDS, "the engine answers /health")
        yield running
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _healthy(running: EngineProcess) -> bool:
    assert running.proc.poll() is None, f"the engine exited:\n{running.log.read_text()[-3000:]}"
    try:
        return httpx.get(f"{running.health_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
