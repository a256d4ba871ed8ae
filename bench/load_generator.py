"""The load generator: a process of its own that sends a benchmark's requests, so the gateway's
event loop (and the engine's) is not shared with the client. It runs two kinds of clients:

- HTTP (bench.streams): chat streams through a gateway, and loads of small GETs;
- the engine's own channel (`RemoteEngineClient`, token ids in and out): the same requests the
  gateway would send, straight to the engine process.

Each job answers its result and the CPU seconds the generator spent on it.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.streams import LoadJob, Sample, StreamJob, closed_loop, run_http_job
from loramux.engine.detokenizer import IncrementalDetokenizer, rust_decoder
from loramux.engine.outputs import EngineRequest
from loramux.gateway.engine_client.remote import RemoteEngineClient


@dataclass(frozen=True)
class DirectJob:
    """Token-id requests sent straight to the engine at `url`, `concurrency` at a time; the
    generator detokenizes their outputs with the tokenizer in `model_dir`."""

    url: str
    token: str | None
    requests: list[EngineRequest]
    concurrency: int
    model_dir: Path


Job = StreamJob | LoadJob | DirectJob


async def direct_one(client: RemoteEngineClient, request: EngineRequest, decoder: Any) -> Sample:
    """One request through the engine's channel. Its first token is where its text starts, as
    the gateway arm's is (bench.streams): the first output whose token ids, detokenized as the
    gateway detokenizes them, add text (or the final output). A token that adds none (a piece
    of a character, say) is not yet text a client could show."""
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    detokenizer = IncrementalDetokenizer(decoder)
    async for out in client.generate(request):
        if first is None and ("".join(detokenizer.add(t) for t in out.token_ids) or out.finished):
            first = time.perf_counter()
        tokens = out.usage.completion_tokens if out.usage is not None else tokens
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, tokens)


@functools.cache
def _decoder(model_dir: Path) -> Any:
    return rust_decoder(AutoTokenizer.from_pretrained(str(model_dir)))


async def run_direct_job(job: DirectJob) -> list[Sample]:
    client = RemoteEngineClient([job.url], job.token)
    await client.start()
    try:
        requests = job.requests
        decoder = _decoder(job.model_dir)
        return await closed_loop(
            lambda _, i: direct_one(client, requests[i], decoder), len(requests), job.concurrency
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
