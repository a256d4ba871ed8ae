"""OpenTelemetry traces of completion requests, after the GenAI semantic conventions.

One trace per completion request (docs/metrics.md draws it):

    chat <model>                    SERVER span of the whole request (the middleware's)
      auth                          the API key check
      admission                     quotas: the reservation, or the 429
      response_cache.lookup         exact then semantic lookup
      engine                        the request inside the engine, from its own timestamps
        engine.queue                waiting for its first step
        engine.prefill              first step to first token
        engine.decode               first token to the end

The engine reports its timestamps with a request's final output (engine.outputs.RequestTimings);
the engine spans are made here, after the fact, with those start and end times.

Attributes name the operation, model, sampling numbers, token counts, finish reasons and ids:
never prompt or completion text, stop sequences or anything else a tenant wrote.

Off unless an OTLP endpoint is configured (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
OTEL_EXPORTER_OTLP_ENDPOINT, read by the exporter as the OpenTelemetry spec says): then no SDK
tracer provider is installed, `enabled()` is false and the request path makes no spans at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from loramux.engine.outputs import RequestTimings
from loramux.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

TRACER = trace.get_tracer("loramux.gateway")
"""Follows the global tracer provider: the one `configure` installs (or a test's)."""

OPERATIONS = {"chat": "chat", "text": "text_completion"}
"""gen_ai.operation.name of a completion of each kind."""

TRACE_CONTEXT = TraceContextTextMapPropagator()


def configure() -> bool:
    """Install the SDK's tracer provider exporting over OTLP/HTTP when an endpoint is set (once
    per process); whether traces are on."""
    if enabled():
        return True
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    ):
        return False
    # Imported here: a gateway without an endpoint never loads the SDK.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME", "loramux-gateway")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info("tracing: exporting spans over OTLP as %s", service)
    return True


def enabled() -> bool:
    """A recording tracer provider is installed."""
    return not isinstance(trace.get_tracer_provider(), ProxyTracerProvider | NoOpTracerProvider)


@contextlib.contextmanager
def request_span(
    operation: str, route: str, request_id: str, headers: Mapping[str, str]
) -> Iterator[Span]:
    """The SERVER span of one completion request, continuing the caller's trace when its
    headers carry one (`callers_trace`)."""
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "loramux",
        "http.request.method": "POST",
        "http.route": route,
        "loramux.request_id": request_id,
    }
    with TRACER.start_as_current_span(
        operation, context=callers_trace(headers), kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span


def callers_trace(headers: Mapping[str, str]) -> Context:
    """The caller's trace to continue: `traceparent`'s ids and flags, nothing else. Its
    `tracestate` and `baggage` are text the tenant wrote: the SDK copies a tracestate into every
    span of the request, and exports it with each."""
    traceparent = headers.get("traceparent")
    return TRACE_CONTEXT.extract({"traceparent": traceparent} if traceparent else {})


def step(name: str) -> contextlib.AbstractContextManager[Span]:
    """A child span of the current one, for a stage of the request path."""
    return TRACER.start_as_current_span(name)


def describe_request(
    operation: str, model: str, params: SamplingParams, stream: bool, tenant_id: str
) -> None:
    """What was asked, on the request's span (once the model is resolved)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.update_name(f"{operation} {model}")
    attributes: dict[str, Any] = {
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.top_k": params.top_k,
        "loramux.stream": stream,
        "loramux.tenant_id": tenant_id,
    }
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    span.set_attributes(attributes)


def describe_result(
    response_id: str,
    model: str,
    usage: tuple[int, int],
    finish: str,
    cache: str,
    timings: RequestTimings | None,
) -> None:
    """What came of it, on the request's span, and the engine's spans under it."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "gen_ai.response.id": response_id,
            "gen_ai.response.model": model,
            "gen_ai.usage.input_tokens": usage[0],
            "gen_ai.usage.output_tokens": usage[1],
            "gen_ai.response.finish_reasons": [finish],
            "loramux.cache": cache,
        }
    )
    if timings is not None:
        engine_spans(span, timings)


def engine_spans(parent: Span, t: RequestTimings) -> None:
    """The engine's phases as spans under `parent`, from the engine's own timestamps."""
    under = trace.set_span_in_context(parent)
    engine = TRACER.start_span("engine", context=under, start_time=_ns(t.arrived))
    inside = trace.set_span_in_context(engine)
    phases = (
        ("engine.queue", t.arrived, t.scheduled),
        ("engine.prefill", t.scheduled, t.first_token),
        ("engine.decode", t.first_token, t.finished),
    )
    for name, start, end in phases:
        if start is not None and end is not None:
            phase = TRACER.start_span(name, context=inside, start_time=_ns(start))
            phase.end(end_time=_ns(end))
    engine.end(end_time=_ns(t.finished))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
