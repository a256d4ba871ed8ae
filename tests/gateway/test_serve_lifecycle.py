"""`loramux serve` as a process tree: it starts a private redis-server and an engine process,
stops them however it is stopped, and restarts either one that dies while it runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from loramux.adapters.demo import build_demo_adapters
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.identity import engine_build
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.service import serve_engine_in_thread
from loramux.gateway.auth.admin_jwt import AdminAuth
from loramux.gateway.openai.models import system_fingerprint
from tests.gateway.serve_process import (
    START_SECONDS,
    Serve,
    alive,
    free_port,
    refusal,
    serve,
    wait_for,
)
from tests.gateway.servers import demo_env
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter

SECRET = "lifecycle-test-secret-" + "x" * 32
STREAMS = 16


@pytest.fixture(scope="module")
def env(demo_model_dir: Path) -> dict[str, str]:
    return demo_env(demo_model_dir, LORAMUX_ADMIN_SECRET=SECRET)


def _admin(url: str) -> httpx.Client:
    token = AdminAuth(SECRET).mint("lifecycle-test")
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=60)


def _stopped_cleanly(running: Serve, sig: signal.Signals) -> None:
    """Stop serve with `sig`: it exits 0 having stopped every child itself."""
    children = running.children()
    running.proc.send_signal(sig)
    assert running.proc.wait(timeout=60) == 0, running.output()
    assert not [pid for pid in children if alive(pid)], running.output()
    # redis-server removes these on a graceful shutdown, not when killed: serve stopped it.
    assert not (running.data_dir / "redis" / "redis.pid").exists()
    assert not (running.data_dir / "redis" / "redis.sock").exists()


def _read_stream(url: str, key: str, flowing: threading.Event) -> list[str]:
    """The data of every event of one long chat stream; `flowing` is set once text arrives."""
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 300,
        "stream": True,
    }
    events = []
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if _has_text(events[-1]):
                    flowing.set()
    return events


def test_sigterm_lets_a_stream_finish_then_stops_serve_and_every_child_it_started(
    env: dict[str, str], tmp_path: Path
) -> None:
    with serve(tmp_path, env) as running:
        # The first start's example request names the port given by --port, not LORAMUX_PORT's.
        output = (tmp_path / "serve.log").read_text()
        assert f"curl {running.url}/v1/chat/completions" in output, output[-2000:]
        names = list(running.children().values())
        assert len(names) == 2, names
        assert any("redis-server" in n for n in names) and any(" engine " in n for n in names)
        with _admin(running.url) as admin:
            key = new_tenant(admin, "sigterm").key
        with ThreadPoolExecutor(1) as pool:
            flowing = threading.Event()
            stream = pool.submit(_read_stream, running.url, key, flowing)
            assert flowing.wait(60), "no text arrived"
            _stopped_cleanly(running, signal.SIGTERM)
            assert stream.result(timeout=60)[-1] == "[DONE]"


def test_with_engine_urls_serve_spawns_no_engine_and_sigint_stops_its_redis(
    env: dict[str, str], demo_model_dir: Path, tmp_path: Path
) -> None:
    config = EngineConfig(model=demo_model_dir, max_model_len=512, kv_cache_bytes=16 << 20)
    engine = AsyncEngine(LLMEngine(config))
    with (
        serve_engine_in_thread(engine, "demo-model", token="external-token") as external,
        serve(
            tmp_path,
            env | {"LORAMUX_ENGINE_URLS": external.url, "LORAMUX_ENGINE_TOKEN": "external-token"},
        ) as running,
    ):
        [child] = running.children().values()
        assert "redis-server" in child
        health = httpx.get(f"{running.url}/health", timeout=10).json()
        assert health["engine"] == "up" and list(health["children"]) == ["redis-server"]
        _stopped_cleanly(running, signal.SIGINT)


def _answers(running: Serve, path: str) -> int | None:
    """The status serve answers `path` with; None while it does not listen yet."""
    assert running.proc.poll() is None, f"serve exited:\n{running.output()}"
    try:
        return httpx.get(f"{running.url}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize("workers", ["1", "2"])
def test_with_its_engine_not_up_yet_serve_starts_degraded_and_serves_once_it_answers(
    env: dict[str, str], demo_model_dir: Path, tmp_path: Path, workers: str
) -> None:
    """Bug: a gateway whose external engine did not listen yet died at its start with a
    traceback. Now it serves degraded, as while its engine is down later: /health 200 saying
    the engine is down, /ready 503, completions 503 `engine_unavailable`; once the engine
    listens at its address, /ready turns 200 and completions are served."""
    address = f"ipc://{tmp_path / 'engine.sock'}"
    external = env | {"LORAMUX_ENGINE_URLS": address, "LORAMUX_ENGINE_TOKEN": "external-token"}
    with serve(tmp_path / "data", external, wait=False, args=("--workers", workers)) as running:
        wait_for(lambda: _answers(running, "/health") == 200, START_SECONDS, "serve serves")
        health = _health(running)
        assert (health["engine"], health["status"]) == ("down", "degraded"), health
        ready = httpx.get(f"{running.url}/ready", timeout=10)
        assert ready.status_code == 503 and not ready.json()["checks"]["engine"], ready.text
        with _admin(running.url) as admin:
            key = new_tenant(admin, "early").key
        refused = _chat(running.url, key)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_unavailable"
        config = EngineConfig(model=demo_model_dir, max_model_len=512, kv_cache_bytes=16 << 20)
        engine = AsyncEngine(LLMEngine(config))
        served_base = f"demo-model@{engine.engine.model_identity}"
        engines = system_fingerprint(engine_build(), served_base, None)
        with serve_engine_in_thread(engine, "demo-model", address=address, token="external-token"):
            wait_for(lambda: _answers(running, "/ready") == 200, 60, "serve is ready")
            served = _chat(running.url, key)
            assert served.status_code == 200, served.text
            # Until the engine answered, the gateway held a stand-in identity of its own; it
            # takes the engine's (its cache keys and fingerprints) once the engine answers.
            wait_for(
                lambda: all(
                    _chat(running.url, key).json()["system_fingerprint"] == engines
                    for _ in range(4)
                ),
                60,
                "every worker takes the engine's identity",
            )
        assert "Traceback" not in running.output(), running.output()


def test_sigterm_while_serve_starts_stops_the_children_started_so_far(
    env: dict[str, str], tmp_path: Path
) -> None:
    with serve(tmp_path, env, wait=False) as running:
        wait_for(
            lambda: any(" engine " in c for c in running.children().values()),
            START_SECONDS,
            "serve spawned its engine",
        )
        children = running.children()
        running.proc.send_signal(signal.SIGTERM)
        assert running.proc.wait(timeout=60) == 0, running.output()
        assert not [pid for pid in children if alive(pid)], running.output()


def test_sigkill_of_serve_takes_its_children_with_it(env: dict[str, str], tmp_path: Path) -> None:
    with serve(tmp_path, env) as running:
        children = running.children()
        assert len(children) == 2
        running.proc.kill()
        running.proc.wait(timeout=30)
        wait_for(lambda: not any(alive(pid) for pid in children), 30, "the children died too")


# -- a start refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MAX_BODY_KB", "1e3"),
        ("PORT", "70000"),
        ("DTYPE", "float8"),
        ("MODEL", "/nonexistent/model"),
        ("DATA_DIR", "/proc/loramux"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_before_anything_starts(
    env: dict[str, str], tmp_path: Path, name: str, value: str
) -> None:
    """Found before any child starts: not by the engine failing to load, nor by a traceback."""
    line = refusal(env | {f"LORAMUX_{name}": value}, tmp_path / "data")
    assert f"LORAMUX_{name}" in line and value in line
    assert not (tmp_path / "data" / "redis").exists()  # no child was started


def test_a_child_that_fails_at_start_or_an_os_error_is_one_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Not ChildFailed or OSError under chained tracebacks. redis-server cannot replace a
    directory where its socket goes; a file where its folder goes stops serve itself. With
    --workers 2 serve waits for its redis-server before importing the gateway: quick."""
    external = env | {"LORAMUX_ENGINE_URLS": f"ipc://{tmp_path / 'no-engine.sock'}"}
    (tmp_path / "child" / "redis" / "redis.sock").mkdir(parents=True)
    line = refusal(external, tmp_path / "child", "--workers", "2")
    log = tmp_path / "child" / "redis" / "redis.log"
    assert (
        line == f"loramux serve: redis-server exited with status 1 before it was ready (see {log})"
    )
    (tmp_path / "oserror").mkdir()
    (tmp_path / "oserror" / "redis").touch()
    line = refusal(external, tmp_path / "oserror", "--workers", "2")
    assert line.startswith("loramux serve: could not start: [Errno 17] File exists"), line


def test_a_port_in_use_is_one_line_naming_it_before_anything_starts(
    env: dict[str, str], tmp_path: Path
) -> None:
    """uvicorn found it only once the gateway was ready to serve, after its children, the
    migration and the first start (which had printed the demo key), and it logged a line of its
    own and exited with status 3, past serve's handling."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal(env, tmp_path / "data", port=port)
    assert line.startswith(f"loramux serve: cannot listen on 127.0.0.1:{port}: "), line
    assert not (tmp_path / "data" / "redis").exists()  # no child was started
    assert not (tmp_path / "data" / "loramux.db").exists()  # nor the first start


# -- a child that dies is restarted --------------------------------------------------------------


@pytest.fixture(scope="module")
def running(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with serve(tmp_path_factory.mktemp("serve-restarts"), env) as running:
        yield running


@pytest.fixture(scope="module")
def adapter_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    [folder] = build_demo_adapters(demo_model_dir, tmp_path_factory.mktemp("adapter"), 1)
    return folder


def _chat(url: str, key: str, model: str = "demo-model", **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(
        f"{url}/v1/chat/completions",
        json=body | extra,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def _health(running: Serve) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{running.url}/health", timeout=10).json()
    return body


def test_an_engine_that_fails_at_start_leaves_its_traceback_in_serves_log(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The engine child writes to serve's own stderr (it inherits it), where serve logs: its
    traceback comes before serve's one line, which points at it. A KV budget that cannot hold
    one sequence stops the engine while it loads."""
    run = subprocess.run(
        [sys.executable, "-m", "loramux.gateway.cli", "serve", "--port", str(free_port())],
        env=os.environ
        | env
        | {"LORAMUX_DATA_DIR": str(tmp_path), "LORAMUX_MAX_MODEL_LEN": "2048"}
        | {"LORAMUX_KV_CACHE_MB": "1"},
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert lines[-1] == (
        "loramux serve: engine exited with status 1 before it was ready (its output is above)"
    )
    crash = next(i for i, line in enumerate(lines) if line.startswith("Traceback"))
    assert any("cannot hold one sequence" in line for line in lines[crash:]), run.stderr[-3000:]


def test_a_second_serve_on_the_same_data_dir_is_refused_and_harms_nothing(
    running: Serve, env: dict[str, str]
) -> None:
    """It started its own redis-server and engine on the first's socket paths; stopping, it
    left the first serve's Redis without a socket file."""
    line = refusal(env, running.data_dir)
    assert str(running.data_dir) in line and f"pid {running.proc.pid}" in line, line
    assert (running.data_dir / "redis" / "redis.sock").exists()
    assert (running.data_dir / "serve.lock").read_text().strip() == str(running.proc.pid)
    assert httpx.get(f"{running.url}/ready", timeout=10).status_code == 200


def test_a_killed_private_redis_is_restarted_and_limited_requests_succeed_again(
    running: Serve,
) -> None:
    with _admin(running.url) as admin:
        tenant = new_tenant(admin, "redis-restart")
        r = admin.put(f"/admin/tenants/{tenant.tenant_id}/quotas", json={"rpm": 100_000})
        assert r.status_code == 200, r.text
    first = _chat(running.url, tenant.key)
    assert first.status_code == 200 and "x-ratelimit-limit-requests" in first.headers
    old = running.redis_pid()
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not alive(old), 10, "redis-server died")

    wait_for(
        lambda: _chat(running.url, tenant.key).status_code == 200, 60, "limited requests succeed"
    )
    assert running.proc.poll() is None
    assert running.redis_pid() != old
    # Clients reconnect as soon as the new redis-server listens; the supervisor marks the
    # child up once its own readiness probe answered, a moment later.
    wait_for(lambda: _health(running)["children"]["redis-server"]["up"], 30, "redis is up")
    redis = _health(running)["children"]["redis-server"]
    assert redis["restarts"] == 1
    assert redis["last_exit"] == "was killed by SIGKILL"


async def _stream(client: httpx.AsyncClient, url: str, key: str, first_text: asyncio.Event) -> str:
    """How one stream ended: `done`, `error` (a clean error event, then the end), or `refused`
    (503 before the first byte). `first_text` is set once text arrived (or it was refused)."""
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 400,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            first_text.set()
            assert r.status_code == 503, await r.aread()
            assert json.loads(await r.aread())["error"]["code"] == "engine_unavailable"
            return "refused"
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if _has_text(events[-1]):  # the engine's stream is flowing
                    first_text.set()
    assert events, "the stream ended without an event"
    if events[-1] == "[DONE]":
        return "done"
    assert json.loads(events[-1])["error"]["code"] == "engine_unavailable", events[-1]
    return "error"


def _has_text(event: str) -> bool:
    if event == "[DONE]":
        return False
    choices = json.loads(event).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


async def _streams_cut_by_engine_kill(running: Serve, key: str) -> list[str]:
    limits = httpx.Limits(max_connections=STREAMS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=None), limits=limits) as client:
        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [
            asyncio.create_task(_stream(client, running.url, key, started[i]))
            for i in range(STREAMS)
        ]
        async with asyncio.timeout(120):
            await asyncio.gather(*(e.wait() for e in started))
        os.kill(running.child(" engine "), signal.SIGKILL)
        async with asyncio.timeout(60):  # none hangs
            return list(await asyncio.gather(*streams))


def test_a_killed_engine_ends_streams_cleanly_and_is_restarted(
    running: Serve, adapter_dir: Path
) -> None:
    with _admin(running.url) as admin:
        tenant: TenantKey = new_tenant(admin, "engine-restart")
        upload_adapter(admin, tenant.tenant_id, "story", adapter_dir)
    assert _chat(running.url, tenant.key, "story").status_code == 200
    engine = running.child(" engine ")

    outcomes = asyncio.run(_streams_cut_by_engine_kill(running, tenant.key))
    assert set(outcomes) <= {"done", "error", "refused"}
    assert "error" in outcomes, outcomes

    health = _health(running)
    refused = _chat(running.url, tenant.key)
    if _health(running)["engine"] == "down":  # not back yet: refused at once
        assert health["status"] == "degraded" and health["engine"] == "down", health
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(f"{running.url}/ready", timeout=10).status_code == 503

    wait_for(
        lambda: httpx.get(f"{running.url}/ready", timeout=10).status_code == 200,
        120,
        "the engine is back",
    )
    # /ready answers once the engine does; the supervisor marks it up after its own probe.
    wait_for(lambda: _health(running)["status"] == "ok", 30, "health is ok again")
    health = _health(running)
    assert health["status"] == "ok" and health["engine"] == "up"
    restarted = health["children"]["engine"]
    assert restarted["restarts"] == 1 and restarted["last_exit"] == "was killed by SIGKILL"
    assert restarted["pid"] != engine and running.child(" engine ") == restarted["pid"]
    assert _chat(running.url, tenant.key).status_code == 200
    after = _chat(running.url, tenant.key, "story")
    assert after.status_code == 200, after.text
