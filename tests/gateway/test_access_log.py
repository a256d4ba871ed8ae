"""The access log of a real `loramux serve` process names each request's path and parameter
names but never a query value: a key sent as `?api_key=` is not written to the log. Text a
client chose enters other log lines escaped and bounded (`loggable`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loramux.gateway.logged_text import MAX_LOGGED_CHARS, loggable
from tests.gateway.serve_process import START_SECONDS, wait_for

SECRETS = ["lmx-querysecret1", "eyJquerysecret2", "lmx-baresecret3", "querysecret4"]
REQUESTS = {
    f"/v1/models?api_key={SECRETS[0]}": "/v1/models?api_key=[redacted]",
    f"/dashboard/data?days=7&tok={SECRETS[1]}": "/dashboard/data?days=[redacted]&tok=[redacted]",
    f"/health?{SECRETS[2]}": "/health?[redacted]",
    f"/ready?api%5Fkey={SECRETS[3]}&=x": "/ready?[redacted]&[redacted]",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(demo_model_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A `loramux serve` process (its URL) whose stdout, where uvicorn writes the access log,
    goes to a file (its path)."""
    port, log = free_port(), tmp_path / "stdout.log"
    env = os.environ | {
        "LORAMUX_DATA_DIR": str(tmp_path / "data"),
        "LORAMUX_MODEL": str(demo_model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_MAX_MODEL_LEN": "512",
        "LORAMUX_KV_CACHE_MB": "16",
        "LORAMUX_REDIS_URL": redis_url,
    }
    command = [sys.executable, "-m", "loramux.gateway.cli", "serve", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: ready(url, proc, log), START_SECONDS, "the gateway is ready")
        yield url, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"the gateway exited:\n{log.read_text()[-3000:]}")
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_query_values_never_reach_the_access_log(served: tuple[str, Path]) -> None:
    url, log = served
    with httpx.Client(base_url=url, timeout=30) as client:
        for target in REQUESTS:
            client.get(target)
    wait_for(
        lambda: all(f'"GET {logged} HTTP/1.1"' in log.read_text() for logged in REQUESTS.values()),
        30,
        "the access log holds every request",
    )
    text = log.read_text()
    leaked = [secret for secret in SECRETS if secret in text]
    assert leaked == [], text[-3000:]


def test_client_text_is_logged_on_one_line_and_bounded() -> None:
    assert (
        loggable("/a\r\nINFO forged\x1b[2J\u2028x\x85") == r"'/a\r\nINFO forged\x1b[2J\u2028x\x85'"
    )
    long = loggable("x" * (MAX_LOGGED_CHARS + 5000))
    assert long == repr("x" * MAX_LOGGED_CHARS) + "… (5,000 more characters)"
