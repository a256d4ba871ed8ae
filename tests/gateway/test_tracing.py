"""Traces of completion requests, caught by the SDK's in-memory exporter: the span tree of one
request (auth, admission, cache lookup, the engine's queue, prefill and decode) with the GenAI
semantic conventions' attributes, and nothing a tenant wrote in them."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from loramux.gateway.server import RunningServer
from tests.gateway.serve_process import wait_for
from tests.gateway.tenants import TenantKey, new_tenant


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span the gateways of this process make, from now on (the global tracer provider
    can be set once per process: later tests keep recording, into an exporter that is shut)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest.fixture(scope="module")
def tenant(gateway: RunningServer, admin_token: str) -> TenantKey:
    headers = {"authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as admin:
        return new_tenant(admin, "traced")


def request_spans(exporter: InMemorySpanExporter, request_id: str) -> list[ReadableSpan]:
    """The spans of the trace whose root is request `request_id`'s, once the root has ended."""
    found: list[ReadableSpan] = []

    def ended() -> bool:
        done = exporter.get_finished_spans()
        roots = [s for s in done if (s.attributes or {}).get("loramux.request_id") == request_id]
        if not roots:
            return False
        trace_id = roots[0].context.trace_id
        found[:] = [s for s in done if s.context.trace_id == trace_id]
        return True

    wait_for(ended, 30, f"the trace of {request_id} has ended")
    return found


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans if s.parent and s.parent.span_id == parent.context.span_id}


def test_a_chat_request_is_one_trace_of_its_stages(
    gateway: RunningServer, tenant: TenantKey, spans: InMemorySpanExporter
) -> None:
    secret = f"my secret plan {uuid.uuid4().hex}"
    body: dict[str, Any] = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": secret}],
        "max_tokens": 6,
        "temperature": 0,  # deterministic: the response cache is looked up
        "stop": ["never-said"],
    }
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {tenant.key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    found = request_spans(spans, r.headers["x-request-id"])
    [root] = [s for s in found if s.parent is None]
    assert root.name == "chat demo-model" and root.kind is SpanKind.SERVER
    attributes = dict(root.attributes or {})
    usage = r.json()["usage"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "demo-model"
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.response.finish_reasons"] == (
        r.json()["choices"][0]["finish_reason"],
    )
    assert attributes["gen_ai.response.id"] == r.json()["id"]
    assert attributes["http.response.status_code"] == 200

    stages = children(found, root)
    assert set(stages) == {"auth", "admission", "response_cache.lookup", "engine"}
    engine = stages["engine"]
    phases = children(found, engine)
    assert set(phases) == {"engine.queue", "engine.prefill", "engine.decode"}
    order = [phases[p] for p in ("engine.queue", "engine.prefill", "engine.decode")]
    for earlier, later in itertools.pairwise(order):
        assert earlier.end_time is not None and later.start_time is not None
        assert earlier.end_time <= later.start_time

    for span in found:  # tenant privacy: no prompt, no stop sequence, in any attribute
        for value in (span.attributes or {}).values():
            assert "secret plan" not in str(value) and "never-said" not in str(value), span.name


def test_a_refused_request_ends_its_trace_at_admission(
    gateway: RunningServer, admin_token: str, spans: InMemorySpanExporter
) -> None:
    headers = {"authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as admin:
        limited = new_tenant(admin, "traced-limited")
        assert admin.put(f"/admin/keys/{limited.key_id}/quotas", json={"rpm": 1}).status_code == 200
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"authorization": f"Bearer {limited.key}"}
    url = f"{gateway.url}/v1/chat/completions"
    assert httpx.post(url, json=body, headers=auth, timeout=60).status_code == 200
    refused = httpx.post(url, json=body, headers=auth, timeout=60)
    assert refused.status_code == 429
    found = request_spans(spans, refused.headers["x-request-id"])
    [root] = [s for s in found if s.parent is None]
    assert set(children(found, root)) == {"auth", "admission"}
    assert dict(root.attributes or {})["http.response.status_code"] == 429


def test_a_streamed_request_continues_the_callers_trace(
    gateway: RunningServer, tenant: TenantKey, spans: InMemorySpanExporter
) -> None:
    trace_id = uuid.uuid4().hex
    headers = {
        "authorization": f"Bearer {tenant.key}",
        "traceparent": f"00-{trace_id}-{'1' * 16}-01",
    }
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "stream"}],
        "max_tokens": 4,
        "stream": True,
    }
    url = f"{gateway.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        assert r.read().endswith(b"data: [DONE]\n\n")
    found = request_spans(spans, request_id)
    root = next(s for s in found if s.kind is SpanKind.SERVER)
    assert root.context.trace_id == int(trace_id, 16)
    assert "engine" in children(found, root)


def test_a_callers_tracestate_and_baggage_reach_no_span(
    gateway: RunningServer, tenant: TenantKey, spans: InMemorySpanExporter
) -> None:
    """The trace is continued from `traceparent`'s ids alone. Bug: the caller's `tracestate`
    was taken too, and the SDK copied it into every span of the request, so whatever a tenant
    wrote there reached the trace backend with each."""
    trace_id = uuid.uuid4().hex
    headers = {
        "authorization": f"Bearer {tenant.key}",
        "cache-control": "no-store",
        "traceparent": f"00-{trace_id}-{'2' * 16}-01",
        "tracestate": "acme=tenant-wrote-this",
        "baggage": "user=tenant-wrote-this-too",
    }
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{gateway.url}/v1/chat/completions"
    r = httpx.post(url, json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    found = request_spans(spans, r.headers["x-request-id"])
    assert {s.context.trace_id for s in found} == {int(trace_id, 16)}  # the caller's trace
    assert {s.name: s.context.trace_state.to_header() for s in found} == {s.name: "" for s in found}
    for span in found:
        assert "tenant-wrote" not in str(dict(span.attributes or {})), span.name
