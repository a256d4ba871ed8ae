"""Streams and request loads driven from a benchmark's client side: a minimal HTTP/1.1 client on
asyncio streams (httpx costs ~10x more CPU per streamed chunk, and the client shares the machine's
cores with the server), OpenAI chat streams read to the end, fixed-duration loads of small GETs,
and the closed loop that keeps a number of requests in flight."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from bench.common import percentile


@dataclass(frozen=True)
class Sample:
    ttft: float
    """Seconds to the first token (the first delta with text, through a gateway)."""
    latency: float
    completion_tokens: int


@dataclass(frozen=True)
class LoadResult:
    seconds: float
    requests: int
    errors: int
    """Answers other than 200."""
    rps: float
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class StreamJob:
    """Chat completion bodies streamed through a gateway, `concurrency` at a time."""

    url: str
    key: str
    bodies: list[bytes]
    concurrency: int


@dataclass(frozen=True)
class LoadJob:
    """`GET path` from `connections` keep-alive connections for `seconds`."""

    url: str
    path: str
    key: str | None
    seconds: float
    connections: int


async def closed_loop(
    run_one: Callable[[int, int], Awaitable[Sample]], count: int, concurrency: int
) -> list[Sample]:
    """Run `run_one(worker, i)` for i in 0..count-1 from `concurrency` workers, each starting
    its next request when its last one ends; samples in request order."""
    samples: dict[int, Sample] = {}
    pending = iter(range(count))

    async def worker(w: int) -> None:
        for i in pending:
            samples[i] = await run_one(w, i)

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return [samples[i] for i in range(count)]


class HttpConnection:
    """One keep-alive HTTP/1.1 connection on asyncio streams: just what this benchmark sends and
    reads, at a fraction of httpx's CPU per streamed chunk."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes):
        self.reader, self.writer, self.head = reader, writer, head
        self.chunked, self.length = False, 0

    @classmethod
    async def open(cls, url: str, key: str | None) -> HttpConnection:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        head = f"host: {parts.netloc}\r\n" + (f"authorization: Bearer {key}\r\n" if key else "")
        return cls(reader, writer, head.encode())

    async def send(self, method: str, path: str, body: bytes = b"") -> int:
        """Send a request and read the response's head; returns the status."""
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\n".encode()
            + self.head
            + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
            + body
        )
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) != b"\r\n":
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        self.chunked = headers.get(b"transfer-encoding") == b"chunked"
        self.length = int(headers.get(b"content-length", b"0"))
        return status

    async def body(self) -> AsyncIterator[bytes]:
        """The response body, piece by piece as the server sends it."""
        if not self.chunked:
            yield await self.reader.readexactly(self.length)
            return
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            yield (await self.reader.readexactly(size + 2))[:-2]
        await self.reader.readline()

    async def read_all(self) -> bytes:
        return b"".join([piece async for piece in self.body()])


async def stream_one(conn: HttpConnection, body: bytes) -> Sample:
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    if (status := await conn.send("POST", "/v1/chat/completions", body)) != 200:
        raise RuntimeError(f"gateway answered {status}: {(await conn.read_all())!r}")
    pending = b""
    async for piece in conn.body():
        *events, pending = (pending + piece).split(b"\n\n")
        for event in events:
            if event == b"data: [DONE]":
                continue
            chunk = json.loads(event.removeprefix(b"data: "))
            if "error" in chunk:
                raise RuntimeError(f"the gateway's stream failed: {chunk['error']}")
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if first is None and (choice["delta"].get("content") or choice["finish_reason"]):
                first = time.perf_counter()
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, tokens)


async def load(job: LoadJob, conns: list[HttpConnection]) -> LoadResult:
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    deadline = start + job.seconds

    async def worker(conn: HttpConnection) -> None:
        nonlocal errors
        while (sent := time.perf_counter()) < deadline:
            status = await conn.send("GET", job.path)
            await conn.read_all()
            latencies.append(time.perf_counter() - sent)
            errors += status != 200

    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - start
    p50, p99 = (percentile(latencies, q) * 1000 for q in (50, 99))
    return LoadResult(wall, len(latencies), errors, len(latencies) / wall, p50, p99)


async def run_http_job(job: StreamJob | LoadJob) -> list[Sample] | LoadResult:
    """Open the job's connections (untimed), run it, close them."""
    count = job.concurrency if isinstance(job, StreamJob) else job.connections
    conns = [await HttpConnection.open(job.url, job.key) for _ in range(count)]
    try:
        if isinstance(job, LoadJob):
            return await load(job, conns)
        bodies = job.bodies
        return await closed_loop(lambda w, i: stream_one(conns[w], bodies[i]), len(bodies), count)
    finally:
        for conn in conns:
            conn.writer.close()
