"""The load generator: a process of its own that sends a benchmark's requests, so the gateway's
event loop (and the engine's) is not shared with the client. It runs two kinds of clients:

- HTTP (bench.streams): chat streams through a gateway, and loads of small GETs;
- the engine's own channel (`RemoteEngineClient`, token ids in and out): the same requests the
  gateway would send, straight to the engine process.

Each job answers its result and the CPU seconds the generator spent on it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from bench.streams import LoadJob, Sample, StreamJob, closed_loop, run_http_job
from loramux.engine.outputs import EngineRequest
from loramux.gateway.engine_client.remote import RemoteEngineClient


@dataclass(frozen=True)
class DirectJob:
    """Token-id requests sent straight to the engine at `url`, `concurrency` at a time."""

    url: str
    token: str | None
    requests: list[EngineRequest]
    concurrency: int


Job = StreamJob | LoadJob | DirectJob


async def direct_one(client: RemoteEngineClient, request: EngineRequest) -> Sample:
    """One request through the engine's channel; the first token is the first output with token
    ids (or the final one)."""
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for out in client.generate(request):
        if first is None and (out.token_ids or out.finished):
            first = time.perf_counter()
        tokens = out.usage.completion_tokens if out.usage is not None else tokens
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, tokens)


async def run_direct_job(job: DirectJob) -> list[Sample]:
    client = RemoteEngineClient([job.url], job.token)
    await client.start()
    try:
        requests = job.requests
        return await closed_loop(
            lambda _, i: direct_one(client, requests[i]), len(requests), job.concurrency
        )
    finally:
        await client.close()


async def run_job(job: Job) -> Any:
    if isinstance(job, DirectJob):
        return await run_direct_job(job)
    return await run_http_job(job)


def generator_main(conn: Connection) -> None:
    """The load generator's process: run each job received, answer (result, CPU seconds)."""
    loop = asyncio.new_event_loop()
    while (job := conn.recv()) is not None:
        cpu = time.process_time()
        try:
            result = loop.run_until_complete(run_job(job))
        except Exception as exc:  # handed to the parent, which raises it
            result = exc
        conn.send((result, time.process_time() - cpu))


class LoadGenerator:
    """The load generator's process. It is forked (a spawned one would spend seconds importing
    torch and the gateway again) before the engine and server start, so it inherits none of
    their threads; it runs only asyncio, sockets and its ZeroMQ channels."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("fork")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=generator_main, args=(child,), daemon=True)
        self._process.start()

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.send(None)
        self._process.join(timeout=30)

    def run(self, job: Job) -> tuple[Any, float]:
        """The job's result and the CPU seconds the generator spent on it."""
        self._conn.send(job)
        result, cpu = self._conn.recv()
        if isinstance(result, Exception):
            raise result
        return result, cpu
