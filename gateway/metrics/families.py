"""The gateway's own series (this process): HTTP, completions, the response cache, quotas and
adapter uploads. Labels stay bounded as tenants and adapters grow: routes (gateway.metrics.routes),
status codes the gateway answers with, finish reasons, cache kinds, limit kinds — never a
tenant, key or adapter name. Counters end in `_total` (prometheus_client adds it).

Every label value known in advance is exposed from the start, at 0: a rate over a series that
has not happened yet is then 0 rather than missing, in dashboards and alerts alike."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from loramux.engine.metrics import REQUEST_BUCKETS, TTFT_BUCKETS
from loramux.gateway.metrics.routes import CHAT, COMPLETIONS, ROUTE_LABELS

COMPLETION_ROUTES = (CHAT, COMPLETIONS)
FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "error")
CACHE_KINDS = ("exact", "semantic")
REFUSALS = ("requests", "tokens", "concurrency", "budget", "backlog")
MODEL_KINDS = ("base", "adapter")


class HttpFamilies:
    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "loramux_http_requests",
            "HTTP requests answered, by route and status code (499: the client left first)",
            ["route", "status"],
            registry=r,
        )
        self.duration = Histogram(
            "loramux_http_request_duration_seconds",
            "From the request's arrival to its last byte (or the client leaving)",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        for route in ROUTE_LABELS:
            self.duration.labels(route)


class CompletionFamilies:
    def __init__(self, r: CollectorRegistry) -> None:
        self.finished = Counter(
            "loramux_request_success",
            "Completions that ran, by finish reason: stop, length, abort (the client left), "
            "error (the engine failed it)",
            ["route", "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "loramux_gateway_time_to_first_token_seconds",
            "Arrival at the gateway to the first token (or the cached answer)",
            ["route", "model_kind"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "loramux_billed_tokens",
            "Tokens billed to tenants, by model kind (base or adapter) and direction",
            ["model_kind", "direction"],
            registry=r,
        )
        for route in COMPLETION_ROUTES:
            for reason in FINISH_REASONS:
                self.finished.labels(route, reason)
            for kind in MODEL_KINDS:
                self.ttft.labels(route, kind)
        for kind in MODEL_KINDS:
            for direction in ("prompt", "completion"):
                self.tokens.labels(kind, direction)


class AdmissionFamilies:
    def __init__(self, r: CollectorRegistry) -> None:
        self.cache_lookups = Counter(
            "loramux_response_cache_lookups",
            "Response-cache lookups (requests whose cache policy allowed one)",
            ["route"],
            registry=r,
        )
        self.cache_hits = Counter(
            "loramux_response_cache_hits",
            "Response-cache hits, by kind: exact or semantic",
            ["route", "kind"],
            registry=r,
        )
        self.quota_refusals = Counter(
            "loramux_quota_refusals",
            "Requests refused with 429 by a limit, by reason: requests, tokens, concurrency, "
            "budget, or backlog (the tenant's bound of prompts waiting to be tokenized)",
            ["reason"],
            registry=r,
        )
        self.adapter_uploads = Counter(
            "loramux_adapter_uploads", "Adapter uploads stored", registry=r
        )
        for route in COMPLETION_ROUTES:
            self.cache_lookups.labels(route)
            for kind in CACHE_KINDS:
                self.cache_hits.labels(route, kind)
        for reason in REFUSALS:
            self.quota_refusals.labels(reason)
