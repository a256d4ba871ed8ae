"""The engine's Prometheus metrics, in one registry the engine renders as text.

Two kinds of series:
- request-path histograms (time to first token, inter-token latency, end-to-end, queue,
  prefill, decode, inference), observed on the step thread as tokens land and requests end;
- state read at scrape time (running and waiting requests, KV use, the cumulative counters
  of `EngineStats`, and one set of series per resident adapter), so a series for an adapter
  exists exactly while the adapter is resident and the labels stay bounded by the adapter
  tiers' capacities.

The text is served by the engine's health endpoint and handed to gateways over the channel
(`Call.op == "metrics"`): any gateway worker renders the same engine-wide series. Names follow
vLLM's after its prefix (docs/metrics.md has the table).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loramux.engine.outputs import RequestTimings
from loramux.engine.sequence import Sequence

if TYPE_CHECKING:
    from loramux.engine.llm_engine import LLMEngine
    from loramux.engine.lora.manager import LoraManager
from loramux.engine.lora.stats import AdapterStats

# No `_created` series beside every counter and histogram (prometheus_client's default, for
# this whole process): they double the series count and no dashboard or alert reads them.
disable_created_metrics()

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets, with a few sub-second ones added: a small model answers in milliseconds."""
LOAD_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Adapter loads: a tiny adapter parses in a millisecond, a rank-64 one of an 8B model in ~1 s."""


class EngineMetrics:
    """The engine's registry: histograms fed by the step thread, state collected on scrape."""

    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"loramux_{name}", doc, buckets=buckets, registry=r)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival at the engine to first token", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between a request's tokens", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival at the engine to the end", REQUEST_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Waiting before the first step", REQUEST_BUCKETS
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "First step to first token", REQUEST_BUCKETS
        )
        self.decode = histogram(
            "request_decode_time_seconds", "First token to the end", REQUEST_BUCKETS
        )
        self.inference = histogram(
            "request_inference_time_seconds", "First step to the end", REQUEST_BUCKETS
        )
        self.lora_load = histogram(
            "lora_load_seconds",
            "Reads of an adapter from disk into host memory, parsing included",
            LOAD_BUCKETS,
        )
        r.register(EngineStateCollector(engine))

    def token_landed(self, seq: Sequence) -> None:
        """A token of `seq` landed (step thread): its first token, or one more interval."""
        now = time.time()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.ttft.observe(max(0.0, now - seq.arrival_time))
        elif seq.last_token_time is not None:
            self.itl.observe(max(0.0, now - seq.last_token_time))
        seq.last_token_time = now

    def request_finished(self, t: RequestTimings) -> None:
        """A request ended (finished, aborted or failed): its phases, as far as it got."""
        self.e2e.observe(max(0.0, t.finished - t.arrived))
        if t.scheduled is None:
            return
        self.queue.observe(max(0.0, t.scheduled - t.arrived))
        self.inference.observe(max(0.0, t.finished - t.scheduled))
        if t.first_token is not None:
            self.prefill.observe(max(0.0, t.first_token - t.scheduled))
            self.decode.observe(max(0.0, t.finished - t.first_token))

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class EngineStateCollector(Collector):
    """Scheduler, KV and adapter state, read off the step thread at scrape time: snapshots
    taken with single C-level copies, so a scrape never sees a container mid-change."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield _gauge("num_requests_running", "Requests in the running batch", stats.running)
        yield _gauge("num_requests_waiting", "Requests waiting to run", stats.waiting)
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        yield _gauge("kv_cache_usage_perc", "KV-cache use; 1 means full", usage)
        yield _gauge("kv_cache_blocks", "KV-cache blocks in the pool", stats.kv_blocks_total)
        threads = torch.get_num_threads()
        yield _gauge(
            "engine_cpu_threads", "torch's intra-op threads in the engine's process", threads
        )
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens computed (prefill)", stats.prompt_tokens_computed),
            ("generation_tokens", "Tokens generated", stats.generated_tokens),
            ("num_preemptions", "Requests preempted (KV freed, recomputed)", stats.preemptions),
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                stats.prefix_cache_query_tokens,
            ),
            (
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                stats.prefix_cache_hit_tokens,
            ),
            ("engine_aborted_requests", "Requests aborted in the engine", stats.aborted),
            ("engine_steps", "Engine steps run", stats.steps),
        ):
            yield CounterMetricFamily(f"loramux_{name}", doc, value=value)
        yield from self._adapters()

    def _adapters(self) -> Iterator[Metric]:
        lora = self.engine.lora
        if lora is None:
            return
        resident = lora.resident()
        scheduler = self.engine.scheduler
        running = Tally(s.adapter_id for s in list(scheduler.running))
        waiting = Tally(s.adapter_id for s in list(scheduler.waiting))
        stats = dict(lora.stats)
        tier = GaugeMetricFamily(
            "loramux_lora_adapter_loaded",
            "Resident adapters (1), by tier: device slot or host memory",
            labels=["adapter", "tier"],
        )
        run = GaugeMetricFamily(
            "loramux_lora_adapter_running_requests", "Running requests", labels=["adapter"]
        )
        wait = GaugeMetricFamily(
            "loramux_lora_adapter_waiting_requests", "Waiting requests", labels=["adapter"]
        )
        loads = CounterMetricFamily(
            "loramux_lora_adapter_loads", "Reads from disk into host memory", labels=["adapter"]
        )
        load_time = CounterMetricFamily(
            "loramux_lora_adapter_load_seconds", "Time spent on those reads", labels=["adapter"]
        )
        device_bytes = GaugeMetricFamily(
            "loramux_lora_adapter_device_bytes",
            "Device adapter memory its weights hold at their ranks (0 in host memory only)",
            labels=["adapter"],
        )
        for digest, where in sorted(resident.items()):
            tier.add_metric([digest, where], 1)
            run.add_metric([digest], running[digest])
            wait.add_metric([digest], waiting[digest])
            adapter = stats.get(digest)
            loads.add_metric([digest], adapter.loads if adapter else 0)
            load_time.add_metric([digest], adapter.load_seconds if adapter else 0.0)
            device_bytes.add_metric([digest], adapter.device_bytes if adapter else 0)
        yield from (tier, run, wait, loads, load_time, device_bytes)
        yield _gauge("lora_slots_pinned", "Device slot pins held", sum(s.pins for s in lora.slots))
        used, total = lora.memory()
        yield _gauge("lora_memory_used_bytes", "Device adapter memory held by adapters", used)
        yield _gauge("lora_memory_free_bytes", "Device adapter memory free", total - used)
        yield from self._cold_path(lora, stats)
        info = GaugeMetricFamily(
            "loramux_lora_requests_info",
            "vLLM's LoRA summary: resident adapters with running or waiting requests (value: now)",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        running_names = ",".join(sorted(d for d in running if d in resident))
        waiting_names = ",".join(sorted(d for d in waiting if d in resident))
        info.add_metric([str(len(lora.slots)), running_names, waiting_names], time.time())
        yield info

    def _cold_path(self, lora: LoraManager, stats: dict[str, AdapterStats]) -> Iterator[Metric]:
        """Loads, device copies and host-path work, over every adapter."""
        yield CounterMetricFamily(
            "loramux_lora_host_path_tokens",
            "Tokens whose LoRA work was computed from the host copy (device copy under way)",
            value=sum(s.host_path_tokens for s in stats.values()),
        )
        yield CounterMetricFamily(
            "loramux_lora_hinted_loads",
            "Adapter loads started by a gateway's prefetch hint",
            value=sum(s.hinted_loads for s in stats.values()),
        )
        yield _gauge(
            "lora_loads_in_flight", "Adapter loads from disk under way", lora.in_flight_loads()
        )
        yield _gauge(
            "lora_copies_in_flight", "Adapter copies into device slots under way", len(lora.copies)
        )
        buffers = GaugeMetricFamily(
            "loramux_lora_host_buffers",
            "Host buffers of the adapter pool, by state",
            labels=["state"],
        )
        counts = lora.host_buffers.counts()
        buffers.add_metric(["in_use"], counts.in_use)
        buffers.add_metric(["free"], counts.free)
        yield buffers


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"loramux_{name}", doc, value=value)
