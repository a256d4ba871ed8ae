"""The end of a completion: its usage event and metrics, and its reservation settled."""

from __future__ import annotations

import time
from dataclasses import dataclass

from loramux.gateway import tracing
from loramux.gateway.metrics import Metrics, completion_route
from loramux.gateway.openai.generation import Generation
from loramux.gateway.openai.prepared import Prepared
from loramux.gateway.openai.responses import Answer
from loramux.gateway.usage import UsageRecord, UsageRecorder


@dataclass(frozen=True)
class Metering:
    metrics: Metrics
    usage: UsageRecorder

    def meter_run(self, p: Prepared, run: Generation) -> None:
        """A run's usage: the prompt counts only when a token was generated."""
        completion = run.completion_tokens
        prompt = p.prompt_tokens if completion else 0
        cached = run.cached_tokens if completion else 0  # of a prompt billed, or none
        finish = run_finish(run, p.answers)
        self._meter(p, prompt, completion, cached, run.status, run.ttft, finish)
        usage = (p.prompt_tokens, completion)
        tracing.describe_result(
            p.meta.id, p.model.name, usage, finish, p.cache.outcome, run.timings
        )

    async def settle_run(self, p: Prepared, run: Generation) -> None:
        completion = run.completion_tokens
        await p.admission.settle((p.prompt_tokens if completion else 0) + completion)

    async def settle_hit(self, p: Prepared, served: bool, first_sent: float | None) -> None:
        """A cache hit's end, metered and settled once, by whichever comes first: its replay's
        end, or its response's (a response can end before its replay starts: a client gone
        when the response starts). `served`: replayed to its end; else the client left (499).
        `first_sent` (time.perf_counter): when its replay's first part went out, its time to
        first token whether or not the client stayed to the end, as for a run. A cache hit
        consumes no tokens."""
        hit = p.cache.hit
        assert hit is not None, "settle_hit settles a cache hit"
        if p.ended:
            return
        p.ended = True
        r = hit.response
        status, finish = (200, r.finish_reason) if served else (499, "abort")
        ttft = first_sent - p.started if first_sent is not None else None
        try:
            self._meter(p, 0, 0, 0, status, ttft, finish)
            usage = (p.prompt_tokens, r.completion_tokens)
            tracing.describe_result(p.meta.id, p.model.name, usage, finish, hit.kind, None)
        finally:
            await p.admission.settle(0)

    def _meter(
        self,
        p: Prepared,
        prompt: int,
        completion: int,
        cached: int,
        status: int,
        ttft: float | None,
        finish: str,
    ) -> None:
        latency = time.perf_counter() - p.started
        kind = "adapter" if p.model.digest else "base"
        route = completion_route(p.meta.kind)
        m = self.metrics.completions
        m.finished.labels(route, finish).inc()
        if ttft is not None:
            m.ttft.labels(route, kind).observe(ttft)
        m.tokens.labels(kind, "prompt").inc(prompt)
        m.tokens.labels(kind, "completion").inc(completion)
        self.usage.record(
            UsageRecord(
                request_id=p.request.request_id,
                tenant_id=p.principal.tenant_id,
                key_id=p.principal.key_id,
                model=p.model.billed_as,
                adapter_digest=p.model.digest,
                prompt_tokens=prompt,
                completion_tokens=completion,
                cached_tokens=cached,
                cache=p.cache.outcome,
                status=status,
                latency_ms=latency * 1000,
                ttft_ms=ttft * 1000 if ttft is not None else None,
                admitted_at=p.admission.admitted_at,
            )
        )


def run_finish(run: Generation, answers: list[Answer]) -> str:
    """How a run ended, for metrics and traces: the first choice's finish reason as its client
    got it when it was served (`tool_calls` for a reply read as tool calls, as a cache hit of it
    counts; the engine's `stop` was counted), `abort` when the client left, `error` otherwise."""
    if run.status == 499:
        return "abort"
    if run.status != 200:
        return "error"
    given = answers[0].finish_reason if answers else None
    return given or run.choices[0].finish or "error"
