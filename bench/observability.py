"""What metrics and traces cost a request, against the gateway's CPU per request.

The calls the request path makes for one completion, run here in a loop on the real objects:
- metrics: the gateway's (the middleware's status and duration, the cache lookup, the finish
  reason, time to first token and billed tokens, as gateway.app and gateway.openai.service make
  them), and the engine's on its step thread (one observation per landed token, one per request);
- traces: the middleware's SERVER span, the auth, admission and cache-lookup spans, the request
  and result attributes and the four engine spans (gateway.tracing), first with no tracer provider
  (the no-op API, as when no OTLP endpoint is configured), then with the SDK's provider exporting
  in batches over OTLP/HTTP to a local sink in a process of its own. CPU time is the process's
  (every thread: the exporter's batches count).

The denominator is the gateway event-loop CPU per streamed request that bench.gateway_overhead
measured (its latest result in bench/results): the whole path, metrics and no traces included.
The shares compare with that figure less what metrics and the no-op traces cost (a build with
both off): what each setting adds, over what such a build spends.

Run: `python -m bench.observability [--quick]`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import CeilingFigure, Figure, Result, configure, parse_args, report
from loramux.engine.outputs import RequestTimings
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import Sequence as EngineSequence
from loramux.gateway import tracing
from loramux.gateway.metrics import Metrics
from loramux.gateway.metrics.routes import CHAT

NAME = "observability"
TOKENS = 16
"""Completion tokens per request (the engine observes one interval per token)."""
FLUSH_EVERY = 100
"""Requests between flushes: 800 spans, within the batch processor's queue of 2,048."""
GATEWAY_RESULT = Path(__file__).parent / "results" / "gateway_overhead-quick.json"
GATEWAY_FIGURE = "gateway event-loop CPU per request"

_SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *args): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def gateway_metrics(m: Metrics) -> None:
    m.http.requests.labels(CHAT, "200").inc()
    m.admission.cache_lookups.labels(CHAT).inc()
    m.completions.finished.labels(CHAT, "stop").inc()
    m.completions.ttft.labels(CHAT, "adapter").observe(0.012)
    m.completions.tokens.labels("adapter", "prompt").inc(40)
    m.completions.tokens.labels("adapter", "completion").inc(TOKENS)
    m.http.duration.labels(CHAT).observe(0.05)


def traced_request(timings: RequestTimings, params: SamplingParams) -> None:
    def body() -> None:
        with tracing.step("auth"):
            pass
        tracing.describe_request("chat", "support-bot", params, True, "tnt_bench")
        with tracing.step("admission"):
            pass
        with tracing.step("response_cache.lookup"):
            pass
        tracing.describe_result("chatcmpl-x", "support-bot", (40, TOKENS), "stop", "miss", timings)

    if tracing.enabled():  # as the middleware does
        headers = {"content-type": "application/json", "authorization": "Bearer x"}
        with tracing.request_span("chat", CHAT, "req_bench", headers):
            body()
    else:
        body()


def cpu_per_call(work: Callable[[], None], calls: int) -> float:
    """Process CPU seconds per call, every thread counted."""
    for _ in range(min(calls, 200)):
        work()
    started = time.process_time()
    for _ in range(calls):
        work()
    return (time.process_time() - started) / calls


@contextmanager
def otlp_sink() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{proc.stdout.readline().strip()}/v1/traces"
    finally:
        proc.kill()
        proc.wait()


def engine_metrics_per_request(calls: int) -> float:
    from loramux.engine.metrics import EngineMetrics

    class _NoEngine:  # the collector reads an engine only on scrape; none happens here
        pass

    metrics = EngineMetrics(_NoEngine())  # type: ignore[arg-type]

    def request() -> None:
        seq = EngineSequence("r", [1, 2, 3], SamplingParams())
        for _ in range(TOKENS):
            metrics.token_landed(seq)
        now = time.time()
        metrics.request_finished(RequestTimings(now - 0.05, now - 0.04, now - 0.03, now))

    return cpu_per_call(request, calls)


def measure(calls: int) -> tuple[dict[str, float], dict[str, Any]]:
    now = time.time()
    timings = RequestTimings(now - 0.05, now - 0.04, now - 0.03, now)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.7)
    seconds = {
        "gateway metrics": cpu_per_call(partial(gateway_metrics, Metrics()), calls),
        "engine metrics": engine_metrics_per_request(calls),
        "traces off (no-op API)": cpu_per_call(lambda: traced_request(timings, params), calls),
    }
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    with otlp_sink() as endpoint:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        trace.set_tracer_provider(provider)
        started = time.process_time()
        for i in range(calls):
            traced_request(timings, params)
            if i % FLUSH_EVERY == FLUSH_EVERY - 1:
                provider.force_flush()  # never outrun the exporter's queue: no span is dropped
        provider.force_flush()  # the batches' export, counted
        seconds["traces on (SDK, OTLP/HTTP)"] = (time.process_time() - started) / calls
        provider.shutdown()
    return seconds, {"requests": calls, "completion_tokens": TOKENS, "otlp": "HTTP, local sink"}


def figures(seconds: dict[str, float], gateway_ms: float) -> list[Figure]:
    out: list[Figure] = [
        Figure(f"{name}, CPU per request", value * 1e6, "us") for name, value in seconds.items()
    ]
    out.append(
        Figure("gateway event-loop CPU per request (bench.gateway_overhead)", gateway_ms, "ms")
    )
    # The gateway's figure was measured with metrics on and traces off: without both, it is less
    # by what they cost, and that is the build the shares compare against.
    metrics, off = seconds["gateway metrics"], seconds["traces off (no-op API)"]
    bare = gateway_ms / 1e3 - metrics - off
    metrics_share = metrics / bare
    off_share = (metrics + off) / bare
    traced_share = (metrics + seconds["traces on (SDK, OTLP/HTTP)"]) / bare
    out += [
        CeilingFigure(
            "metrics on, traces off: added CPU / gateway CPU", off_share, "ratio", goal_max=0.05
        ),
        CeilingFigure(
            "metrics and traces on: added CPU / gateway CPU", traced_share, "ratio", goal_max=0.15
        ),
        Figure("metrics alone: CPU / gateway CPU", metrics_share, "ratio"),
    ]
    return out


def main(argv: Sequence[str] | None = None) -> Path:
    settings = parse_args(__doc__ or NAME, argv)
    configure(settings)
    calls = {"smoke": 200, "quick": 5_000}.get(settings.mode, 50_000)
    gateway_ms = next(
        f["value"]
        for f in json.loads(GATEWAY_RESULT.read_text())["figures"]
        if f["name"] == GATEWAY_FIGURE
    )
    seconds, workload = measure(calls)
    details = {"cpu_seconds_per_request": seconds, "gateway_result": GATEWAY_RESULT.name}
    model = {"name": "none: the calls of the request path, without a model"}
    return report(
        Result(NAME, settings, model, workload, {}, figures(seconds, gateway_ms), details)
    )


if __name__ == "__main__":
    main()
