"""What the gateway adds to a streaming request, whether the engine keeps its pace behind it, and
how many authenticated `GET /v1/models` the gateway answers per second.

1. Overhead. One engine process (the engine service, bench.engine_process), on the torch threads
   `loramux serve --workers 1` gives its engine (the cores the gateway leaves), serves both arms; a
   real gateway (bench.gateway_rig) connects to it over the ZeroMQ channel, as `loramux serve` with
   LORAMUX_ENGINE_URLS runs it (uvicorn on loopback, SQLite, a private redis-server), with a
   tenant and key made through the admin API. Both arms are sent by a load generator in its own
   process (bench.load_generator), so neither shares an event loop with what it measures:
   - gateway arm: `POST /v1/chat/completions`, `stream: true`, temperature 0;
   - direct arm: the engine's channel (`RemoteEngineClient`), with the token-id requests the
     gateway builds from the same bodies (tokenized by the gateway's own `PromptTokens`).
   Each window draws fresh prompts and runs them through both arms, one after the other, with
   `concurrency` in flight (closed loop: a finished request starts the next); windows alternate
   which arm goes first, to cancel drift. The prefix cache is off so the second arm does not find
   the first arm's prompts cached: both compute the same tokens. The same comparison then runs
   with one request in flight: what the gateway's path adds to a request by itself. Time to first
   token ends at the first delta with text in both arms (direct, the first whose token ids add
   text when detokenized as the gateway does: about one demo-model reply in seven starts with a
   token that adds none, and counting that token would charge the next step to the gateway);
   latency when the stream ends
   (after `data: [DONE]` for the gateway). Added = gateway - direct, per percentile.
   Engine steps per second: the engine's `steps` counter over each arm's wall time; the gateway
   arm's over the direct arm's says whether the gateway keeps the engine as busy as a direct
   client does. Beside it, completion tokens per second (both arms generate the same tokens):
   on a CPU a step's time grows with its batch, and an arm whose engine shares its cores with
   a busy gateway runs fewer, larger steps, so the step rate can fall while the token rate
   holds.
2. CPU per request, which other processes' load barely moves: the gateway event-loop thread's
   (gateway arm minus its idle cost during the direct arm), and the load generator's per arm.
   Its floor: sequential no-op round trips (`GET /health` on one keep-alive connection).
3. `GET /v1/models` (authenticated) and `GET /health` under many keep-alive connections from the
   same client process: requests per second, latency p50 and p99.
4. Hotspots: one more gateway window under cProfile on the gateway's event-loop thread
   (bench.gateway_profile).

Run: `python -m bench.gateway_overhead [--quick]`.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import (
    CeilingFigure,
    Figure,
    Result,
    load_details,
    percentile,
    prepared_run,
    report,
)
from bench.gateway_profile import profile_gateway
from bench.gateway_rig import MODEL_NAME, Rig, engine_config, running_rig
from bench.load_generator import DirectJob, LoadGenerator
from bench.streams import LoadJob, LoadResult, Sample, StreamJob
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams

NAME = "gateway_overhead"
GOAL_ADDED_TTFT_MS = 2.0
"""Added time to first token at p50, one request in flight."""
GOAL_ADDED_TTFT_SHARE = 0.1
"""Added time to first token at p50 over the direct arm's, `concurrency` requests in flight."""
GOAL_STEP_RATE_RATIO = 0.9
"""Engine steps per second under the gateway arm over the direct arm's."""
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


def engine_request(rig: Rig, prompt: str, workload: Workload) -> EngineRequest:
    """What the gateway sends the engine for `chat_body(prompt)`: token ids, tokenized by the
    gateway's own `PromptTokens` (outside the timed run)."""
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0)
    messages = [{"role": "user", "content": prompt}]
    text = EngineRequest(f"direct-{uuid.uuid4().hex}", params, messages=messages)
    ids = rig.on_loop(rig.server.state.prompts.prompt_ids(text))
    return EngineRequest(text.request_id, params, prompt_token_ids=ids)


@dataclass
class Arm:
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    engine_steps: int = 0
    server_cpu: float = 0.0
    """CPU seconds of this process (the gateway, its tokenizer threads) while the arm ran."""
    loop_cpu: float = 0.0
    """CPU seconds of the gateway's event-loop thread."""
    client_cpu: float = 0.0
    """CPU seconds of the load generator's process."""
    window_latency_p50: list[float] = field(default_factory=list)

    @property
    def steps_per_second(self) -> float:
        return self.engine_steps / self.seconds

    @property
    def tokens_per_second(self) -> float:
        return sum(s.completion_tokens for s in self.samples) / self.seconds


async def _loop_cpu() -> float:
    return time.thread_time()


def run_arm(rig: Rig, gateway: bool, prompts: list[str], workload: Workload, arm: Arm) -> None:
    """Run one window's prompts through one arm and add what it measured to `arm`."""
    concurrency = workload.concurrency
    job: StreamJob | DirectJob
    if gateway:
        job = StreamJob(
            rig.server.url, rig.key, [chat_body(p, workload) for p in prompts], concurrency
        )
    else:
        requests = [engine_request(rig, p, workload) for p in prompts]
        model_dir = rig.server.state.prompts.model_dir
        job = DirectJob(rig.engine.url, None, requests, concurrency, model_dir)
    steps, loop_cpu = rig.engine_steps(), rig.on_loop(_loop_cpu())
    cpu, wall = time.process_time(), time.perf_counter()
    samples, client_cpu = rig.generator.run(job)
    arm.seconds += time.perf_counter() - wall
    arm.engine_steps += rig.engine_steps() - steps
    if gateway:
        rig.on_loop(rig.server.state.usage.flush())  # metering it would do in the background
    arm.server_cpu += time.process_time() - cpu
    arm.loop_cpu += rig.on_loop(_loop_cpu()) - loop_cpu
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


# -- figures ------------------------------------------------------------------------------------
def ms(arm: Arm, attr: str, q: float) -> float:
    return percentile([getattr(s, attr) for s in arm.samples], q) * 1000


def arm_figures(gateway: Arm, direct: Arm, streams: int) -> list[Figure]:
    """Many streams: times per arm and added, the added TTFT's share of the direct one, engine
    steps per second under each arm, and CPU per request."""
    at = f"{streams} streams"
    figures: list[Figure] = []
    for label, attr in (("time to first token", "ttft"), ("latency", "latency")):
        for q in (50, 99):
            g, d = ms(gateway, attr, q), ms(direct, attr, q)
            figures += [
                Figure(f"{label} p{q}, gateway, {at}", g, "ms"),
                Figure(f"{label} p{q}, engine direct, {at}", d, "ms"),
                Figure(f"{label} p{q}, added, {at}", g - d, "ms"),
            ]
    ttft_g, ttft_d = ms(gateway, "ttft", 50), ms(direct, "ttft", 50)
    figures.append(
        CeilingFigure(
            f"time to first token p50, added / direct, {at}",
            (ttft_g - ttft_d) / ttft_d,
            "ratio",
            goal_max=GOAL_ADDED_TTFT_SHARE,
        )
    )
    figures += [
        Figure(
            f"engine steps per second, {at} through the gateway", gateway.steps_per_second, "1/s"
        ),
        Figure(f"engine steps per second, {at} direct", direct.steps_per_second, "1/s"),
        Figure(
            f"engine steps per second, gateway / direct, {at}",
            gateway.steps_per_second / direct.steps_per_second,
            "ratio",
            goal_min=GOAL_STEP_RATE_RATIO,
        ),
        # The same tokens in both arms: on a CPU a step's time grows with its batch, so an
        # arm can run fewer, larger steps at the same token rate; this says which it was.
        Figure(
            f"completion tokens per second, gateway / direct, {at}",
            gateway.tokens_per_second / direct.tokens_per_second,
            "ratio",
        ),
    ]
    n = len(gateway.samples)
    added_loop = (gateway.loop_cpu - direct.loop_cpu) / n * 1000
    figures.append(Figure("gateway event-loop CPU per request", added_loop, "ms"))
    figures.append(
        Figure("client CPU per request, gateway stream", gateway.client_cpu / n * 1000, "ms")
    )
    figures.append(
        Figure("client CPU per request, engine direct", direct.client_cpu / n * 1000, "ms")
    )
    return figures


def serial_figures(gateway: Arm, direct: Arm) -> list[Figure]:
    """One stream: the gateway's own path, without the contention of many streams."""
    ttft = [ms(gateway, "ttft", q) - ms(direct, "ttft", q) for q in (50, 99)]
    latency = ms(gateway, "latency", 50) - ms(direct, "latency", 50)
    return [
        CeilingFigure(
            "time to first token p50, added, 1 stream", ttft[0], "ms", goal_max=GOAL_ADDED_TTFT_MS
        ),
        Figure("time to first token p99, added, 1 stream", ttft[1], "ms"),
        Figure("latency p50, added, 1 stream", latency, "ms"),
    ]


def arm_details(arm: Arm) -> dict[str, Any]:
    n = len(arm.samples)
    return {
        "requests": n,
        "seconds": arm.seconds,
        "completion_tokens": sum(s.completion_tokens for s in arm.samples),
        "engine_steps": arm.engine_steps,
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


def profile_window(rig: Rig, workload: Workload) -> dict[str, Any]:
    bodies = [chat_body(p, workload) for p in prompts_for(workload, 10_000)]
    job = StreamJob(rig.server.url, rig.key, bodies, workload.concurrency)
    return profile_gateway(rig.server.loop, lambda: len(rig.generator.run(job)[0]))


def measure(rig: Rig, workload: Workload) -> tuple[list[Figure], dict[str, Any]]:
    load_start = os.getloadavg()
    url, seconds, conns = rig.server.url, workload.load_seconds, workload.load_connections
    noop, noop_cpu = rig.generator.run(LoadJob(url, "/health", None, seconds, 1))
    gateway, direct = run_windows(rig, workload)
    serial_gateway, serial_direct = run_windows(rig, workload.serial)
    profile = profile_window(rig, workload)
    models, _ = rig.generator.run(LoadJob(url, "/v1/models", rig.key, seconds, conns))
    health, _ = rig.generator.run(LoadJob(url, "/health", None, seconds, conns))
    load_end = os.getloadavg()
    figures = serial_figures(serial_gateway, serial_direct)
    figures += arm_figures(gateway, direct, workload.concurrency)
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
        "load_average": load_details(load_start, load_end),
    }
    return figures, details


def main(argv: Sequence[str] | None = None) -> Path:
    with LoadGenerator() as generator, prepared_run(__doc__ or NAME, argv) as run:
        settings, workload = run.settings, WORKLOADS[run.settings.mode]
        with running_rig(settings, run.model_dir, run.workdir, generator) as rig:
            figures, details = measure(rig, workload)
    engine = {k: str(v) for k, v in asdict(engine_config(settings, run.model_dir)).items()}
    return report(Result(NAME, settings, run.model, asdict(workload), engine, figures, details))


if __name__ == "__main__":
    main()
