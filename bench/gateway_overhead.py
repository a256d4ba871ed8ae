"""What the gateway adds to a streaming request, and how many authenticated `GET /v1/models` it
answers per second.

1. Overhead. One `AsyncEngine` serves both arms; a real gateway wraps it, as `loramux serve`
   runs it (uvicorn on loopback, SQLite, a private redis-server), with a tenant and key made
   through the admin API.
   - gateway arm: `POST /v1/chat/completions`, `stream: true`, temperature 0, sent by a load
     generator in its own process, so the gateway's event loop is not shared with it;
   - direct arm: the same engine's `generate` with the request the gateway builds, run on the
     gateway's own event loop.
   Each window draws fresh prompts and runs them through both arms, one after the other, with
   `concurrency` in flight (closed loop: a finished request starts the next); windows alternate
   which arm goes first, to cancel drift. The prefix cache is off so the second arm does not find
   the first arm's prompts cached: both compute the same tokens. The same comparison then runs
   with one request in flight: what the gateway's path adds to a request by itself, without the
   contention of many streams for the cores (and the GIL the gateway shares with the in-process
   engine). Time to first token ends at the first delta with text; latency when the stream ends
   (after `data: [DONE]` for the gateway). Added = gateway - direct, per percentile.
2. CPU per request, which other processes' load barely moves: the gateway event-loop thread's,
   gateway arm minus direct arm (this process's total is in `details`; its engine part varies
   with load), and the client's. The client shares the machine's cores with the server, so it is
   kept cheap (a minimal HTTP/1.1 client on asyncio streams; httpx costs ~10x more per chunk).
   Its floor: sequential no-op round trips (`GET /health` on one keep-alive connection).
3. `GET /v1/models` (authenticated) and `GET /health` under many keep-alive connections from the
   same client process: requests per second, latency p50 and p99.
4. Hotspots: one more gateway window under cProfile on the gateway's event-loop thread; the
   functions with the most own time per request are in `details.profile`.

Run: `python -m bench.gateway_overhead [--quick]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import json
import multiprocessing
import os
import pstats
import random
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.common import (
    Figure,
    Result,
    RunSettings,
    available_cores,
    configure,
    parse_args,
    prepare_model,
    report,
)
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.outputs import EngineRequest
from engine.sampling import SamplingParams
from gateway.db.migrate import upgrade
from gateway.engine_client.local import LocalEngineClient
from gateway.redis_server import private_redis
from gateway.server import RunningServer, serve_in_thread
from gateway.settings import ServerSettings, Settings

NAME = "gateway_overhead"
MODEL_NAME = "demo-model"
GOAL_ADDED_MS = 2.0
WORDS = """the quick brown fox jumps over a lazy dog while seven river otters count smooth
stones under an old stone bridge near the quiet harbour of a northern town""".split()  # noqa: SIM905


@dataclass(frozen=True)
class Workload:
    concurrency: int
    requests_per_window: int
    """Requests each arm runs per window (the same prompts in both arms)."""
    windows: int
    prompt_words: tuple[int, int]
    """Inclusive range of words per user message."""
    max_tokens: int
    load_seconds: float
    """Duration of each load run (no-op round trips, `/v1/models`, `/health`)."""
    load_connections: int
    serial_windows: int
    """Windows of the same comparison with one request in flight, `requests_per_window / 16`
    requests each: the gateway's own path, without the contention of many streams."""
    seed: int = 0

    @property
    def serial(self) -> Workload:
        """The one-in-flight variant, with prompts of its own (a response cache never hits)."""
        per_window = max(1, self.requests_per_window // 16)
        return replace(
            self,
            concurrency=1,
            requests_per_window=per_window,
            windows=self.serial_windows,
            seed=self.seed + 1,
        )


WORKLOADS = {
    "full": Workload(64, 128, 16, (16, 48), 32, 10.0, 64, serial_windows=8),
    "quick": Workload(64, 64, 4, (16, 48), 16, 2.0, 64, serial_windows=2),
    "smoke": Workload(4, 4, 1, (4, 8), 4, 0.3, 4, serial_windows=1),
}


@dataclass(frozen=True)
class CeilingFigure(Figure):
    """A figure whose goal is an upper bound (`Figure` only knows lower bounds)."""

    goal_max: float | None = None

    @property
    def met(self) -> bool | None:
        return None if self.goal_max is None else self.value <= self.goal_max

    def as_dict(self) -> dict[str, Any]:
        goal = None if self.goal_max is None else f"<= {self.goal_max:g}"
        return {**super().as_dict(), "goal": goal}


@dataclass(frozen=True)
class Sample:
    ttft: float
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


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


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


# -- the load generator's process ---------------------------------------------------------------
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


@dataclass(frozen=True)
class StreamJob:
    url: str
    key: str
    bodies: list[bytes]
    concurrency: int


@dataclass(frozen=True)
class LoadJob:
    url: str
    path: str
    key: str | None
    seconds: float
    connections: int


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


async def run_job(job: StreamJob | LoadJob) -> Any:
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
    their threads; it runs only asyncio and sockets."""

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

    def run(self, job: StreamJob | LoadJob) -> tuple[Any, float]:
        """The job's result and the CPU seconds the generator spent on it."""
        self._conn.send(job)
        result, cpu = self._conn.recv()
        if isinstance(result, Exception):
            raise result
        return result, cpu


# -- the server side ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Rig:
    engine: AsyncEngine
    server: RunningServer
    key: str
    generator: LoadGenerator

    def on_loop(self, coro: Awaitable[Any]) -> Any:
        """Run a coroutine on the gateway's event loop and wait for it (no time limit)."""
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result()  # type: ignore[arg-type]


def engine_config(settings: RunSettings, model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        dtype=settings.dtype,
        device=settings.device,
        max_model_len=512,
        max_num_seqs=64,
        max_num_batched_tokens=2048 if settings.is_cuda else 512,
        kv_cache_bytes=(8 << 30) if settings.is_cuda else (256 << 20),
        enable_prefix_caching=False,
    )


def tenant_key(server: RunningServer) -> str:
    """A new tenant and API key, made through the admin API."""
    token = server.state.admin.mint("bench-gateway-overhead", ttl_seconds=3600)
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as admin:
        tenant = admin.post("/admin/tenants", json={"name": f"bench-{uuid.uuid4().hex[:8]}"})
        tenant.raise_for_status()
        key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={"name": "bench"})
        key.raise_for_status()
        return str(key.json()["key"])


@contextlib.contextmanager
def running_rig(
    settings: RunSettings, model_dir: Path, workdir: Path, generator: LoadGenerator
) -> Iterator[Rig]:
    engine = AsyncEngine.from_config(engine_config(settings, model_dir))
    server_settings = ServerSettings(model_name=MODEL_NAME)
    gateway_settings = Settings(
        data_dir=workdir / "gateway", model=model_dir, server=server_settings
    )
    upgrade(gateway_settings.database_url)
    client = LocalEngineClient(engine, MODEL_NAME)
    with (
        private_redis(gateway_settings.data_dir) as redis_url,
        serve_in_thread(gateway_settings, client, model_dir, redis_url=redis_url) as server,
    ):
        yield Rig(engine, server, tenant_key(server), generator)


# -- the two arms -------------------------------------------------------------------------------
def prompts_for(workload: Workload, window: int) -> list[str]:
    rng = random.Random(workload.seed * 100_003 + window)
    lo, hi = workload.prompt_words
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
        for _ in range(workload.requests_per_window)
    ]


def chat_body(prompt: str, workload: Workload) -> bytes:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": workload.max_tokens,
    }
    return json.dumps(body).encode()


def engine_request(prompt: str, workload: Workload) -> EngineRequest:
    """What the gateway builds from `chat_body(prompt)`."""
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0)
    messages = [{"role": "user", "content": prompt}]
    return EngineRequest(f"direct-{uuid.uuid4().hex}", params, messages=messages)


async def direct_one(engine: AsyncEngine, request: EngineRequest) -> Sample:
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for out in engine.generate(request):
        if first is None and (out.token_ids or out.finished):
            first = time.perf_counter()
        tokens = out.usage.completion_tokens if out.usage is not None else tokens
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, tokens)


@dataclass
class Arm:
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    server_cpu: float = 0.0
    """CPU seconds of this process (engine, gateway and all) while the arm ran."""
    loop_cpu: float = 0.0
    """CPU seconds of the gateway's event-loop thread (which runs the direct arm's consumers)."""
    client_cpu: float = 0.0
    """CPU seconds of the load generator's process (0 for the direct arm)."""
    window_latency_p50: list[float] = field(default_factory=list)


async def _loop_cpu() -> float:
    return time.thread_time()


def run_arm(rig: Rig, gateway: bool, prompts: list[str], workload: Workload, arm: Arm) -> None:
    """Run one window's prompts through one arm and add what it measured to `arm`."""
    bodies = [chat_body(p, workload) for p in prompts]
    requests = [engine_request(p, workload) for p in prompts]
    concurrency = workload.concurrency
    cpu, wall, loop_cpu = time.process_time(), time.perf_counter(), rig.on_loop(_loop_cpu())
    client_cpu = 0.0
    if gateway:
        job = StreamJob(rig.server.url, rig.key, bodies, concurrency)
        samples, client_cpu = rig.generator.run(job)
        rig.on_loop(rig.server.state.usage.flush())  # metering it would do in the background
    else:
        runs = closed_loop(
            lambda _, i: direct_one(rig.engine, requests[i]), len(requests), concurrency
        )
        samples = rig.on_loop(runs)
    arm.loop_cpu += rig.on_loop(_loop_cpu()) - loop_cpu
    arm.seconds += time.perf_counter() - wall
    arm.server_cpu += time.process_time() - cpu
    arm.client_cpu += client_cpu
    arm.samples.extend(samples)
    arm.window_latency_p50.append(percentile([s.latency for s in samples], 50))


def run_windows(rig: Rig, workload: Workload) -> tuple[Arm, Arm]:
    """A warm-up window (not kept), then `windows` windows, alternating which arm goes first."""
    warm = prompts_for(workload, -1)[: workload.concurrency]
    run_arm(rig, True, warm, workload, Arm())
    run_arm(rig, False, warm, workload, Arm())
    gateway, direct = Arm(), Arm()
    for window in range(workload.windows):
        prompts = prompts_for(workload, window)
        for through_gateway in (True, False) if window % 2 == 0 else (False, True):
            run_arm(rig, through_gateway, prompts, workload, gateway if through_gateway else direct)
    return gateway, direct


# -- hotspots and request rates -----------------------------------------------------------------
async def _call(action: Callable[[], object]) -> None:
    action()


def profile_gateway(rig: Rig, workload: Workload, top: int = 20) -> dict[str, Any]:
    """cProfile on the gateway's event-loop thread during one gateway window: the functions with
    the most own time per request, idle waits in epoll left out. Times are wall time, so a call
    that releases the GIL (a socket send) includes waiting to take it back from the engine's step
    thread; cProfile inflates pure-Python functions, so compare them with each other."""
    profiler = cProfile.Profile()
    bodies = [chat_body(p, workload) for p in prompts_for(workload, 10_000)]
    rig.on_loop(_call(profiler.enable))
    rig.generator.run(StreamJob(rig.server.url, rig.key, bodies, workload.concurrency))
    rig.on_loop(_call(profiler.disable))
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    busy = {k: v for k, v in stats.items() if "select.epoll" not in k[2]}
    rows = sorted(busy.items(), key=lambda item: item[1][2], reverse=True)
    n = len(bodies)
    return {
        "requests": n,
        "busy_ms_per_request": sum(v[2] for v in busy.values()) / n * 1000,
        "top_by_own_time": [
            {
                "function": f"{'/'.join(Path(file).parts[-2:])}:{line}({func})",
                "calls_per_request": round(calls / n, 2),
                "own_us_per_request": round(own / n * 1e6, 1),
                "cumulative_us_per_request": round(cum / n * 1e6, 1),
            }
            for (file, line, func), (_, calls, own, cum, _) in rows[:top]
        ],
    }


# -- figures ------------------------------------------------------------------------------------
def ms(arm: Arm, attr: str, q: float) -> float:
    return percentile([getattr(s, attr) for s in arm.samples], q) * 1000


def arm_figures(gateway: Arm, direct: Arm) -> list[Figure]:
    figures: list[Figure] = []
    for label, attr in (("time to first token", "ttft"), ("latency", "latency")):
        for q in (50, 99):
            g, d = ms(gateway, attr, q), ms(direct, attr, q)
            goal = GOAL_ADDED_MS if q == 50 else None
            figures += [
                Figure(f"{label} p{q}, gateway", g, "ms"),
                Figure(f"{label} p{q}, engine direct", d, "ms"),
                CeilingFigure(f"{label} p{q}, added", g - d, "ms", goal_max=goal),
            ]
    n = len(gateway.samples)
    added_loop = (gateway.loop_cpu - direct.loop_cpu) / n * 1000
    figures.append(Figure("event-loop CPU per request, added by the gateway", added_loop, "ms"))
    figures.append(Figure("client CPU per streamed request", gateway.client_cpu / n * 1000, "ms"))
    return figures


def serial_figures(gateway: Arm, direct: Arm) -> list[Figure]:
    return [
        Figure(
            f"{label} p50, added, one request in flight",
            ms(gateway, a, 50) - ms(direct, a, 50),
            "ms",
        )
        for label, a in (("time to first token", "ttft"), ("latency", "latency"))
    ]


def arm_details(arm: Arm) -> dict[str, Any]:
    n = len(arm.samples)
    return {
        "requests": n,
        "seconds": arm.seconds,
        "completion_tokens": sum(s.completion_tokens for s in arm.samples),
        "server_cpu_seconds": arm.server_cpu,
        "loop_cpu_seconds": arm.loop_cpu,
        "client_cpu_seconds": arm.client_cpu,
        **{
            f"{attr}_ms": {
                f"p{q}": percentile([getattr(s, attr) for s in arm.samples], q) * 1000
                for q in (10, 50, 90, 99)
            }
            for attr in ("ttft", "latency")
        },
    }


def rate_figures(label: str, result: LoadResult) -> list[Figure]:
    return [
        Figure(f"{label}: requests per second", result.rps, "req/s"),
        Figure(f"{label}: latency p50", result.p50_ms, "ms"),
        Figure(f"{label}: latency p99", result.p99_ms, "ms"),
    ]


def measure(rig: Rig, workload: Workload) -> tuple[list[Figure], dict[str, Any]]:
    load_start = os.getloadavg()
    url, seconds, conns = rig.server.url, workload.load_seconds, workload.load_connections
    noop, noop_cpu = rig.generator.run(LoadJob(url, "/health", None, seconds, 1))
    gateway, direct = run_windows(rig, workload)
    serial_gateway, serial_direct = run_windows(rig, workload.serial)
    profile = profile_gateway(rig, workload)
    models, _ = rig.generator.run(LoadJob(url, "/v1/models", rig.key, seconds, conns))
    health, _ = rig.generator.run(LoadJob(url, "/health", None, seconds, conns))
    load_end = os.getloadavg()
    figures = arm_figures(gateway, direct) + serial_figures(serial_gateway, serial_direct)
    figures.append(Figure("no-op round trip p50 (GET /health, one connection)", noop.p50_ms, "ms"))
    figures += rate_figures(f"GET /v1/models, authenticated, {conns} connections", models)
    figures += rate_figures(f"GET /health, no-op, {conns} connections", health)
    details = {
        "gateway_arm": arm_details(gateway),
        "direct_arm": arm_details(direct),
        "serial_gateway_arm": arm_details(serial_gateway),
        "serial_direct_arm": arm_details(serial_direct),
        "added_latency_p50_by_window_ms": [
            (g - d) * 1000
            for g, d in zip(gateway.window_latency_p50, direct.window_latency_p50, strict=True)
        ],
        "noop_round_trip": {**asdict(noop), "client_cpu_ms": noop_cpu / noop.requests * 1000},
        "models_rate": asdict(models),
        "health_rate": asdict(health),
        "profile": profile,
        "load_average": {
            "start": [round(x, 2) for x in load_start],
            "end": [round(x, 2) for x in load_end],
            "busy": max(load_start[0], load_end[0]) > available_cores(),
        },
    }
    return figures, details


def main(argv: Sequence[str] | None = None) -> Path:
    settings = parse_args(__doc__ or NAME, argv)
    configure(settings)
    workload = WORKLOADS[settings.mode]
    with LoadGenerator() as generator, tempfile.TemporaryDirectory(prefix="loramux-bench-") as tmp:
        model_dir, model = prepare_model(settings, Path(tmp))
        with running_rig(settings, model_dir, Path(tmp), generator) as rig:
            figures, details = measure(rig, workload)
    engine = {k: str(v) for k, v in asdict(engine_config(settings, model_dir)).items()}
    return report(Result(NAME, settings, model, asdict(workload), engine, figures, details))


if __name__ == "__main__":
    main()
