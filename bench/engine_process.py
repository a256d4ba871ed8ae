"""The engine in a process of its own for a benchmark: the engine service `loramux engine` runs
(engine.service), on a loopback tcp:// channel and health port, built from the benchmark's own
`EngineConfig` (its run's settings mapped by `EngineSettings.engine_config`, not this process's
environment). Spawned, not forked: the engine's threads and torch start fresh."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.service.runner import Listen, serve_engine, use_cpu_threads

START_SECONDS = 300.0


@dataclass(frozen=True)
class RunningEngine:
    url: str
    """Where clients connect (tcp://)."""
    health_url: str


def engine_main(config: EngineConfig, model_name: str, adapter_dir: Path, conn: Connection) -> None:
    """The engine process: serve until the parent sends anything (or goes away)."""
    use_cpu_threads(config)
    asyncio.run(_serve(config, model_name, adapter_dir, conn))


async def _serve(
    config: EngineConfig, model_name: str, adapter_dir: Path, conn: Connection
) -> None:
    engine = AsyncEngine.from_config(config)
    ready, stop, bound = threading.Event(), asyncio.Event(), list[str]()
    listen = Listen("tcp://127.0.0.1:0")
    service = asyncio.create_task(
        serve_engine(
            engine, model_name, listen, adapter_dir=adapter_dir, ready=ready, bound=bound, stop=stop
        )
    )
    await asyncio.to_thread(ready.wait)
    conn.send(bound)
    with contextlib.suppress(EOFError):
        await asyncio.to_thread(conn.recv)
    stop.set()
    await service


@contextlib.contextmanager
def engine_process(config: EngineConfig, model_name: str, workdir: Path) -> Iterator[RunningEngine]:
    """Start the engine process; yield once its channel and /health answer; stop it on exit."""
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    args = (config, model_name, workdir / "engine-adapters", child)
    process = context.Process(target=engine_main, args=args, daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + START_SECONDS
        while not conn.poll(0.2):
            if not process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the engine process did not start (exit code {process.exitcode})"
                )
        url, health_url = conn.recv()
        yield RunningEngine(url, health_url)
    finally:
        with contextlib.suppress(BrokenPipeError):
            conn.send(None)
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()
