"""/metrics after a short mixed load, as Prometheus and the shipped Grafana dashboard read it:
counters end in `_total` and grow, histograms observe every request, per-adapter series live
exactly while the adapter is resident, and every series a dashboard panel queries exists."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from loramux.adapters.demo import build_demo_adapters
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.service.health import create_health_app
from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.health import PROBE_INTERVAL as ENGINE_METRICS_INTERVAL
from loramux.gateway.metrics import Metrics
from loramux.gateway.metrics.collectors import Degradation
from loramux.gateway.server import RunningServer
from tests.gateway.serve_process import wait_for
from tests.gateway.servers import gateway_server
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter

DASHBOARD = Path(__file__).parents[2] / "docker" / "grafana" / "loramux.json"
METRICS_DOC = Path(__file__).parents[2] / "docs" / "metrics.md"
CHAT = "/v1/chat/completions"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(gateway: RunningServer) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and every family's type by name."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def chat(gateway: RunningServer, key: str, **body: Any) -> httpx.Response:
    payload = {"messages": [{"role": "user", "content": "metrics"}], "max_tokens": 4, **body}
    payload.setdefault("model", "demo-model")
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{gateway.url}{CHAT}", json=payload, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def load(
    gateway: RunningServer,
    admin_token: str,
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """The mixed load, run once: the scrapes before and after it, and what it used."""
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {admin_token}"}, timeout=120
    ) as admin:
        before, _ = scrape(gateway)
        tenant = new_tenant(admin, "metrics")
        # Adapters of their own (a seed no other test uses): their digests retire on delete.
        folders = build_demo_adapters(demo_model_dir, tmp_path_factory.mktemp("a"), 2, seed=16)
        adapter = upload_adapter(admin, tenant.tenant_id, "metrics-bot", folders[0])
        upload_adapter(admin, tenant.tenant_id, "other-bot", folders[1])
        limited = new_tenant(admin, "metrics-limited")
        r = admin.put(f"/admin/keys/{limited.key_id}/quotas", json={"rpm": 1})
        assert r.status_code == 200, r.text
        _run_load(gateway, tenant, limited, before)
        after, types = scrape(gateway)
        yield {
            "before": before,
            "after": after,
            "types": types,
            "adapter": adapter,
            "tenant": tenant,
            "admin": admin,
        }


def _run_load(gateway: RunningServer, tenant: TenantKey, limited: TenantKey, before: Any) -> None:
    assert chat(gateway, tenant.key, temperature=0).status_code == 200
    hit = chat(gateway, tenant.key, temperature=0)
    assert hit.headers["x-cache"] == "exact"
    for model in ("metrics-bot", "other-bot"):
        assert chat(gateway, tenant.key, model=model, temperature=0.5).status_code == 200
    assert chat(gateway, tenant.key, max_tokens="many").status_code == 400
    assert chat(gateway, limited.key).status_code == 200
    assert chat(gateway, limited.key).status_code == 429
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "long"}]}
    body |= {"max_tokens": 300, "stream": True, "temperature": 0.7}
    headers = {"authorization": f"Bearer {tenant.key}"}
    with httpx.stream("POST", f"{gateway.url}{CHAT}", json=body, headers=headers) as r:
        lines = r.iter_lines()
        for _ in range(3):  # a streamed request, left after its first chunks
            next(lines)

    def aborted() -> bool:  # by this load (an earlier module's may be counted already)
        samples, _ = scrape(gateway)
        name = "loramux_request_success_total"
        return total(samples, name, finished_reason="abort") > total(
            before, name, finished_reason="abort"
        )

    wait_for(aborted, 30, "the abandoned stream is counted as an abort")


def grew(load: dict[str, Any], name: str, **labels: str) -> float:
    return total(load["after"], name, **labels) - total(load["before"], name, **labels)


def test_counters_end_in_total_and_count_the_load(load: dict[str, Any]) -> None:
    for name, kind in load["types"].items():
        assert name.startswith("loramux_"), name
        if kind == "counter":
            assert all(
                n.endswith("_total") for n, _ in load["after"] if n.startswith(name + "_")
            ), name
    assert grew(load, "loramux_http_requests_total", route=CHAT, status="200") >= 5
    assert grew(load, "loramux_http_requests_total", route=CHAT, status="400") == 1
    assert grew(load, "loramux_http_requests_total", route=CHAT, status="429") == 1
    assert grew(load, "loramux_quota_refusals_total", reason="requests") == 1
    assert grew(load, "loramux_adapter_uploads_total") == 2
    assert grew(load, "loramux_response_cache_hits_total", route=CHAT, kind="exact") == 1
    assert grew(load, "loramux_response_cache_lookups_total", route=CHAT) >= 2
    assert grew(load, "loramux_generation_tokens_total") > 0
    assert grew(load, "loramux_prefix_cache_queries_total") > 0
    # Read at scrape time, from the start at 0 (a purge racing a store counts one: below).
    assert any(n == "loramux_response_cache_fenced_total" for n, _ in load["after"])


def test_every_series_is_documented(load: dict[str, Any]) -> None:
    """docs/metrics.md lists every series, the gateway's and the engines' (its table rows name
    them as they are scraped: a counter with its `_total`)."""
    documented = set(re.findall(r"`(loramux_\w+)`", METRICS_DOC.read_text()))
    scraped = {n + "_total" if t == "counter" else n for n, t in load["types"].items()}
    assert scraped - documented == set()


def test_cache_writes_a_purge_refused_are_exposed() -> None:
    """Bug: the cache counted the writes its purge fence refused (`CacheStats.fenced`), and
    no series exposed them."""
    text = Metrics().render(Degradation(0, {}, 0, {}, {}, cache_fenced=2), {}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.value for s in families["loramux_response_cache_fenced"].samples] == [2.0]


def test_series_whose_labels_are_known_in_advance_are_exposed_from_the_start() -> None:
    """A fresh gateway's histograms by route and model kind are there at 0 before any request,
    so a rate over them (a base-only deployment's adapter TTFT) is 0, not missing."""
    text = Metrics().render(Degradation(0, {}, 0, {}), {}).decode()
    counts = {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.endswith("_count")
    }
    for route in (CHAT, "/v1/completions"):
        for kind in ("base", "adapter"):
            labels = frozenset({("route", route), ("model_kind", kind)})
            assert counts[("loramux_gateway_time_to_first_token_seconds_count", labels)] == 0
    for route in (CHAT, "/v1/models", "/health", "/ready", "/metrics", "/admin", "other"):
        labels = frozenset({("route", route)})
        assert counts[("loramux_http_request_duration_seconds_count", labels)] == 0, route


def test_finish_reasons_count_aborts_apart_from_errors(load: dict[str, Any]) -> None:
    finished = {
        reason: grew(load, "loramux_request_success_total", route=CHAT, finished_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    }
    assert finished["abort"] >= 1 and finished["error"] == 0, finished
    # Two plain answers, the two adapters' and the cache hit: stop or length.
    assert finished["stop"] + finished["length"] == 5, finished


def test_histograms_observe_the_requests(load: dict[str, Any]) -> None:
    for name in (
        "loramux_time_to_first_token_seconds",
        "loramux_inter_token_latency_seconds",
        "loramux_e2e_request_latency_seconds",
        "loramux_request_queue_time_seconds",
        "loramux_request_prefill_time_seconds",
        "loramux_request_decode_time_seconds",
    ):
        assert grew(load, f"{name}_count") >= 5, name  # 5 ran in the engine, one was cached
    assert grew(load, "loramux_gateway_time_to_first_token_seconds_count", route=CHAT) == 6
    assert grew(load, "loramux_http_request_duration_seconds_count", route=CHAT) >= 8
    assert 0 <= total(load["after"], "loramux_kv_cache_usage_perc") <= 1


def test_every_dashboard_query_reads_a_live_series(load: dict[str, Any]) -> None:
    names = {n for n, _ in load["after"]}
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queries = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert queries
    for expr in queries:
        for metric in re.findall(r"\bloramux_[A-Za-z0-9_:]*", expr):
            assert metric in names, f"{metric} (in {expr!r}) is not in /metrics"


def test_adapter_series_exist_while_it_is_resident(
    gateway: RunningServer, load: dict[str, Any]
) -> None:
    digest = load["adapter"]["digest"]
    assert total(load["after"], "loramux_lora_adapter_loaded", adapter=digest) == 1
    assert (
        "loramux_lora_adapter_running_requests",
        frozenset({("adapter", digest), ("engine", "0")}),
    ) in load["after"]
    tenant = load["tenant"]
    r = load["admin"].delete(f"/admin/adapters/{tenant.tenant_id}/metrics-bot")
    assert r.status_code == 200, r.text

    def gone() -> bool:
        assert chat(gateway, tenant.key).status_code == 200  # a step sweeps retired adapters
        samples, _ = scrape(gateway)
        return not any(dict(labels).get("adapter") == digest for _, labels in samples)

    wait_for(gone, 30, "the deleted adapter's series are gone")


def test_scrapes_without_pause_reach_the_engines_at_most_once_an_interval(
    gateway: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/metrics needs no credentials, and each answer holds the engines' series: 300 scrapes
    at once and back to back ask the engines at most once per ENGINE_METRICS_INTERVAL (each
    ask is a render on every engine's event loop: a client scraping without pause loaded every
    engine), and a scrape after a pause asks again (fresh)."""
    engine = gateway.state.engine
    asked: list[float] = []
    real = engine.metrics

    async def metrics() -> dict[str, str | None]:  # the real one, counted
        asked.append(time.monotonic())
        return await real()

    monkeypatch.setattr(engine, "metrics", metrics)

    async def scrapes() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            together = await asyncio.gather(*(client.get("/metrics") for _ in range(150)))
            return [*together, *[await client.get("/metrics") for _ in range(150)]]

    start = time.monotonic()
    answers = asyncio.run(scrapes())
    elapsed = time.monotonic() - start
    assert all(a.status_code == 200 for a in answers)
    assert all("loramux_kv_cache_usage_perc" in a.text for a in answers)
    assert 1 <= len(asked) <= elapsed / ENGINE_METRICS_INTERVAL + 1, (len(asked), elapsed)
    time.sleep(ENGINE_METRICS_INTERVAL)
    before = len(asked)
    assert httpx.get(f"{gateway.url}/metrics").status_code == 200
    assert len(asked) == before + 1


@pytest.mark.parametrize("route", ["/health", "/ready"])
def test_health_checks_without_pause_reach_the_engines_at_most_once_an_interval(
    gateway: RunningServer, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """/health and /ready need no credentials; each asked every engine whether it runs (a stats
    call on its event loop; /ready also the database and Redis) per request: 300 requests now
    ask at most once an interval."""
    engine = gateway.state.engine
    asked: list[float] = []
    method = "stats" if route == "/health" else "ready"
    real = getattr(engine, method)

    async def counted() -> Any:  # the real one, counted
        asked.append(time.monotonic())
        return await real()

    monkeypatch.setattr(engine, method, counted)

    async def checks() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            together = await asyncio.gather(*(client.get(route) for _ in range(150)))
            return [*together, *[await client.get(route) for _ in range(150)]]

    time.sleep(ENGINE_METRICS_INTERVAL)
    start = time.monotonic()
    answers = asyncio.run(checks())
    elapsed = time.monotonic() - start
    assert all(a.status_code == 200 for a in answers), answers[-1].text
    assert all(a.json()["engine" if route == "/health" else "checks"] for a in answers)
    assert 1 <= len(asked) <= elapsed / ENGINE_METRICS_INTERVAL + 1, (len(asked), elapsed)


def test_with_a_metrics_token_only_a_scrape_bearing_it_reads_the_gateway_or_the_engine(
    demo_model_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-adapter series name digests, so an open /metrics told anyone who reached the port
    which adapters the engine holds (and each scrape made the engines render). With
    LORAMUX_METRICS_TOKEN a scrape needs it, on the gateway and on the engine's own port;
    /health and /ready stay open to orchestrators."""
    monkeypatch.setenv("LORAMUX_METRICS_TOKEN", "scrape-secret")
    engine_render = 0

    with gateway_server(demo_model_dir, tmp_path / "data", redis_url) as gateway:
        real = gateway.state.engine.metrics

        async def counted() -> list[str]:  # the real one, counted
            nonlocal engine_render
            engine_render += 1
            return await real()

        monkeypatch.setattr(gateway.state.engine, "metrics", counted)
        for header in ({}, {"authorization": "Bearer wrong"}, {"authorization": "scrape-secret"}):
            refused = httpx.get(f"{gateway.url}/metrics", headers=header)
            assert refused.status_code == 401 and "LORAMUX_METRICS_TOKEN" in refused.text
        assert engine_render == 0, "a refused scrape asked the engines"
        good = {"authorization": "Bearer scrape-secret"}
        assert "loramux_" in httpx.get(f"{gateway.url}/metrics", headers=good).text
        assert httpx.get(f"{gateway.url}/health").status_code == 200

    engine = AsyncEngine(LLMEngine(EngineConfig(model=demo_model_dir, max_model_len=512)))
    with TestClient(create_health_app(engine, "scrape-secret")) as port:
        assert port.get("/metrics").status_code == 401
        assert "loramux_" in port.get("/metrics", headers=good).text
        assert port.get("/health").status_code in (200, 503)


def engine_labels(url: str) -> set[str]:
    """The `engine` labels of the engines' series on the gateway's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        s.labels["engine"]
        for f in text_string_to_metric_families(text)
        if f.name == "loramux_kv_cache_blocks"
        for s in f.samples
    }


def test_an_engine_keeps_its_label_while_an_engine_before_it_is_down(
    two_engine_gateway: tuple[list[RunningEngineService], RunningServer],
) -> None:
    """engine="<index in LORAMUX_ENGINE_URLS>": with the first of two engines down, the second's
    series were labelled engine="0", passing for the dead engine's."""
    engines, gw = two_engine_gateway
    wait_for(lambda: engine_labels(gw.url) == {"0", "1"}, 30, "both engines scraped")
    engines[0].stop()
    wait_for(lambda: len(engine_labels(gw.url)) == 1, 30, "engine 0 left the scrape")
    assert engine_labels(gw.url) == {"1"}
