"""Series read at scrape time: counts other parts keep (Redis failures, the usage recorder), and
the engines' series, merged from the text each engine renders (engine.metrics)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

QUOTA_REDIS_DOWN = ("refused", "unchecked", "unsettled", "dropped")
USAGE_DROPS = ("buffer_full", "refused", "shutdown")
"""The labels these counts take (gateway.quotas.service, gateway.usage.recorder): each is
exposed from the start, at 0, so a rate over it is 0 rather than missing."""


@dataclass(frozen=True)
class Degradation:
    """What the gateway's parts count themselves, read at each scrape."""

    cache_errors: int
    quota_redis_down: Mapping[str, int]
    usage_buffered: int
    usage_dropped: Mapping[str, int]
    cache_decisions: Mapping[str, int] = field(default_factory=dict)
    """The semantic cache's near misses, verifier refusals (`refused_<check>`) and reported
    wrong hits, summed over tenants (per tenant: GET /admin/tenants/{id}/cache/stats)."""
    cache_fenced: int = 0
    """Cache writes refused because a purge (or the tenant's deletion) came after their lookup."""


@dataclass(eq=False)
class DegradationCollector(Collector):
    """The counts as of the last `update` (none before the first scrape)."""

    latest: Degradation | None = None

    def update(self, degradation: Degradation) -> None:
        self.latest = degradation

    def collect(self) -> Iterator[Metric]:
        d = self.latest
        if d is None:
            return
        yield CounterMetricFamily(
            "loramux_response_cache_errors",
            "Cache operations skipped because Redis (or the embedder) failed",
            value=d.cache_errors,
        )
        yield CounterMetricFamily(
            "loramux_response_cache_fenced",
            "Cache writes refused because a purge came after their lookup (cache.purge)",
            value=d.cache_fenced,
        )
        down = CounterMetricFamily(
            "loramux_quota_redis_down",
            "Admissions decided without Redis, by outcome",
            labels=["outcome"],
        )
        for outcome in sorted(set(QUOTA_REDIS_DOWN) | set(d.quota_redis_down)):
            down.add_metric([outcome], d.quota_redis_down.get(outcome, 0))
        yield down
        yield GaugeMetricFamily(
            "loramux_usage_events_buffered",
            "Usage events waiting to be written",
            value=d.usage_buffered,
        )
        dropped = CounterMetricFamily(
            "loramux_usage_events_dropped",
            "Usage events given up (billing data lost; each is logged at ERROR)",
            labels=["reason"],
        )
        for reason in sorted(set(USAGE_DROPS) | set(d.usage_dropped)):
            dropped.add_metric([reason], d.usage_dropped.get(reason, 0))
        yield dropped
        decisions = CounterMetricFamily(
            "loramux_response_cache_decisions",
            "Semantic near misses, verifier refusals (refused_<check>) and reported wrong hits",
            labels=["outcome"],
        )
        for outcome, count in sorted(d.cache_decisions.items()):
            decisions.add_metric([outcome], count)
        yield decisions


@dataclass(eq=False)
class EngineSeries(Collector):
    """The engines' series as of the last `update`, each sample labelled `engine` with the
    engine's label (EngineClient.metrics: its index in LORAMUX_ENGINE_URLS, 0 for the
    in-process one, or a Ray Serve replica's id), as vLLM labels them. An engine that did not
    answer is None in `texts` and has no series; no other engine takes its label."""

    texts: dict[str, str | None] = field(default_factory=dict)

    def update(self, texts: dict[str, str | None]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for label, text in self.texts.items():
            if text is None:
                continue
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for s in family.samples:
                    labels = s.labels | {"engine": label}
                    into.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
