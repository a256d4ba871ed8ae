"""Prometheus metrics of one gateway process. Labels stay bounded as tenants and adapters grow:
routes, status classes and model kinds (base or adapter) — never tenant, key or adapter names."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loramux_requests", "API requests", ["route", "status"], registry=r)
        self.latency = Histogram(
            "loramux_request_seconds",
            "Request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "loramux_time_to_first_token_seconds",
            "Time to first token",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "loramux_tokens", "Tokens processed", ["kind", "direction"], registry=r
        )
        self.engine_running = Gauge(
            "loramux_engine_running_sequences", "Sequences running", registry=r
        )
        self.engine_waiting = Gauge(
            "loramux_engine_waiting_sequences", "Sequences waiting", registry=r
        )
        self.kv_used = Gauge("loramux_engine_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge("loramux_engine_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.prefix_hits = Gauge(
            "loramux_engine_prefix_cache_hit_tokens", "Prefix-cache hit tokens", registry=r
        )
        self.cache = Counter(
            "loramux_response_cache", "Response-cache outcomes", ["outcome"], registry=r
        )
        self.cache_errors = Gauge(
            "loramux_response_cache_errors",
            "Cache operations skipped because Redis failed",
            registry=r,
        )
        self.cache_decisions = Gauge(
            "loramux_response_cache_decisions",
            "Semantic near misses, verifier refusals (refused_<check>) and reported wrong hits"
            " (per tenant: GET /admin/tenants/{id}/cache/stats)",
            ["outcome"],
            registry=r,
        )
        self.quota_redis_down = Gauge(
            "loramux_quota_redis_down", "Admissions decided without Redis", ["outcome"], registry=r
        )
        self.usage_dropped = Gauge(
            "loramux_usage_events_dropped",
            "Usage events given up (billing data lost; each is logged at ERROR)",
            ["reason"],
            registry=r,
        )
        self.usage_buffered = Gauge(
            "loramux_usage_events_buffered", "Usage events waiting to be written", registry=r
        )
        self.adapter_loads = Counter(
            "loramux_adapter_uploads", "Adapter uploads", ["outcome"], registry=r
        )

    def observe_degradation(self, cache_errors: int, quota_redis_down: Mapping[str, int]) -> None:
        """Copy the cache's and the limiter's Redis-failure counts (kept by them) into gauges."""
        self.cache_errors.set(cache_errors)
        for outcome, count in quota_redis_down.items():
            self.quota_redis_down.labels(outcome).set(count)

    def observe_cache_decisions(self, counts: Mapping[str, int]) -> None:
        """Copy the response cache's decision counts (summed over tenants) into a gauge."""
        for outcome, count in counts.items():
            self.cache_decisions.labels(outcome).set(count)

    def observe_usage(self, buffered: int, dropped: Mapping[str, int]) -> None:
        """Copy the usage recorder's backlog and drop counts (kept by it) into gauges."""
        self.usage_buffered.set(buffered)
        for reason, count in dropped.items():
            self.usage_dropped.labels(reason).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
