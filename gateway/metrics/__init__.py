"""Prometheus metrics of one gateway process, and the engines' series it passes on.

`/metrics` renders this process's series (families) and, merged in, what each engine renders
(engine.metrics), fetched over the engine channel at scrape time: any gateway worker answers
with the same engine-wide series. Under `loramux serve --workers N` (PROMETHEUS_MULTIPROC_DIR
set, gateway.serve_workers) the families are summed over every worker's files; the counts read
at scrape time (collectors.Degradation) stay the answering worker's. docs/metrics.md lists every
series and its vLLM name."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from loramux.gateway.metrics.collectors import Degradation, DegradationCollector, EngineSeries
from loramux.gateway.metrics.families import AdmissionFamilies, CompletionFamilies, HttpFamilies
from loramux.gateway.metrics.routes import completion_route, route_label

__all__ = ["Degradation", "Metrics", "completion_route", "route_label"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http = HttpFamilies(self.registry)
        self.completions = CompletionFamilies(self.registry)
        self.admission = AdmissionFamilies(self.registry)
        self.degradation = DegradationCollector()
        self.engines = EngineSeries()
        self.exposed = self.registry
        if folder := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed, folder)
        self.exposed.register(self.degradation)
        self.exposed.register(self.engines)

    def render(self, degradation: Degradation, engine_texts: dict[str, str | None]) -> bytes:
        """The exposition text, with the counts and engines' series read for this scrape."""
        self.degradation.update(degradation)
        self.engines.update(engine_texts)
        return generate_latest(self.exposed)
