"""`loramux serve --workers 2`: two gateway processes share the port, one engine process and one
private redis-server; what is registered through one serves through the other, and SIGTERM stops
every process serve started."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loramux.adapters.demo import build_demo_adapters
from loramux.gateway.auth.admin_jwt import AdminAuth
from tests.gateway.serve_process import Serve, alive, refusal, serve, wait_for
from tests.gateway.tenants import new_tenant, upload_adapter

SECRET = "workers-test-secret-" + "x" * 32


def _worker(running: Serve, index: int, **headers: str) -> httpx.Client:
    """A client of one worker alone, through its control socket."""
    socket = running.data_dir.resolve() / "workers" / f"{index}.sock"
    transport = httpx.HTTPTransport(uds=str(socket))
    return httpx.Client(base_url="http://worker", transport=transport, headers=headers, timeout=60)


def test_two_workers_share_one_engine_and_redis_and_sigterm_stops_them_all(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    env = {
        "LORAMUX_MODEL": str(demo_model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_MAX_MODEL_LEN": "512",
        "LORAMUX_KV_CACHE_MB": "8",
        "LORAMUX_ADMIN_SECRET": SECRET,
    }
    with serve(tmp_path / "serve", env, args=("--workers", "2")) as running:
        wait_for(lambda: len(running.children()) == 4, 60, "serve runs 4 children")
        commands = list(running.children().values())
        assert sum(" engine " in c for c in commands) == 1, commands
        assert sum("redis-server" in c for c in commands) == 1, commands
        workers = {pid for pid, c in running.children().items() if "--listen-fd" in c}
        assert len(workers) == 2, commands

        # Connections to the shared port land on both workers.
        answered: set[int] = set()

        def both_answered() -> bool:
            answered.add(httpx.get(f"{running.url}/health", timeout=10).json()["pid"])
            return answered == workers

        wait_for(both_answered, 60, "both workers answered on the shared port")

        admin = {"authorization": f"Bearer {AdminAuth(SECRET).mint('workers-test')}"}
        [folder] = build_demo_adapters(demo_model_dir, tmp_path / "adapter", 1)
        with _worker(running, 0, **admin) as first:
            tenant = new_tenant(first, "workers")
            upload_adapter(first, tenant.tenant_id, "story", folder)
        body = {"model": "story", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        user = {"authorization": f"Bearer {tenant.key}"}
        with _worker(running, 1, **user) as second:
            r = second.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] is not None
            assert second.get("/health").json()["pid"] != _worker_pid(running, 0)
        with _worker(running, 0) as first:  # the other worker's /metrics counts it too
            metrics = first.get("/metrics").text
        assert _completions_counted(metrics) == 1
        # The engine runs torch on the cores the two workers leave (at least one), not on all.
        # (Its series are in a worker's /metrics when the engine answered that scrape's probe.)
        threads: list[float] = []

        def engine_scraped() -> bool:
            with _worker(running, 0) as first:
                text = first.get("/metrics").text
            threads.append(_sample(text, "loramux_engine_cpu_threads"))
            return threads[-1] > 0

        wait_for(engine_scraped, 30, "the engine's series reach a worker's /metrics")
        assert threads[-1] == max(1, len(os.sched_getaffinity(0)) - 2)

        children = running.children()
        running.proc.send_signal(signal.SIGTERM)
        assert running.proc.wait(timeout=90) == 0, running.output()
        assert not [pid for pid in children if alive(pid)], running.output()
        assert not (running.data_dir / "redis" / "redis.pid").exists()


def _completions_counted(metrics: str) -> float:
    return _sample(metrics, "loramux_request_success_total")


def _sample(metrics: str, name: str) -> float:
    """The sum of the samples named `name`."""
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == name
    )


def _worker_pid(running: Serve, index: int) -> int:
    with _worker(running, index) as client:
        pid: int = client.get("/health").json()["pid"]
    return pid


def test_a_port_another_process_listens_on_is_refused_in_one_line_with_workers(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """The workers bound the port each with SO_REUSEPORT, which lets any process of the same
    user that sets it join: a second `serve --workers 2` (another data directory, another
    database) joined the first's, as this socket does, without a word, and the kernel spread the
    first's clients over both. Now the workers share their parent's one socket, bound without
    it, so a port in use is refused as with one worker."""
    env = {
        "LORAMUX_MODEL": str(demo_model_dir),
        "LORAMUX_ENGINE_URLS": f"ipc://{tmp_path / 'no-engine.sock'}",
    }
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal(env, tmp_path / "data", "--workers", "2", port=port)
    assert line.startswith(f"loramux serve: cannot listen on 127.0.0.1:{port}: "), line
    assert not (tmp_path / "data" / "redis").exists()  # no child was started
