"""The response cache through the gateway: exact and semantic hits with their headers, the
controls (Cache-Control, the body's `cache` extension, tenant settings), isolation between
tenants, adapter versions and base-model checkpoints, purges, and a Redis restart that fails no
request."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.cache.keys import Keyspace, glob_escape
from loramux.engine.demo_model import build_demo_model
from loramux.gateway.cache.service import CacheAdmin
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.servers import gateway_server
from tests.gateway.tenants import TenantKey, after_its_delete, new_tenant, upload_adapter
from tests.redis import RedisServer

QUESTION = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"


@pytest.fixture
def api(gateway: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=120) as c:
        yield c


def unique(question: str) -> str:
    """The question in a conversation of its own (tests share the gateway and its cache)."""
    return f"{question} [{uuid.uuid4().hex[:8]}]"


def ask(
    api: httpx.Client,
    tenant: TenantKey,
    content: str,
    *,
    headers: dict[str, str] | None = None,
    model: str = "demo-model",
    system: str = "You answer briefly.",
    **extra: Any,
) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
    } | extra
    auth = {"authorization": f"Bearer {tenant.key}"}
    r = api.post("/v1/chat/completions", json=body, headers=auth | (headers or {}))
    assert r.status_code == 200, r.text
    return r


def streamed(api: httpx.Client, tenant: TenantKey, content: str, **extra: Any) -> tuple[str, str]:
    """(x-cache, the concatenated text) of a streamed request."""
    body = {
        "model": "demo-model",
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
    } | extra
    auth = {"authorization": f"Bearer {tenant.key}"}
    with api.stream("POST", "/v1/chat/completions", json=body, headers=auth) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        outcome = r.headers["x-cache"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return outcome, text


def text_of(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


def semantic_tenant(admin: httpx.Client, **settings: Any) -> TenantKey:
    tenant = new_tenant(admin, "semantic")
    r = admin.put(f"/admin/tenants/{tenant.tenant_id}/cache", json={"semantic": True} | settings)
    assert r.status_code == 200, r.text
    return tenant


def test_an_identical_request_is_an_exact_hit_with_the_same_shape(
    admin: httpx.Client, api: httpx.Client
) -> None:
    tenant = new_tenant(admin, "exact")
    question = unique(QUESTION)
    first = ask(api, tenant, question)
    second = ask(api, tenant, question)
    assert first.headers["x-cache"] == "miss"
    assert second.headers["x-cache"] == "exact"
    assert "x-cache-similarity" not in second.headers
    a, b = first.json(), second.json()
    assert a.keys() == b.keys() and a["choices"][0].keys() == b["choices"][0].keys()
    assert b["choices"][0]["message"] == a["choices"][0]["message"]
    assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
    assert b["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    assert b["object"] == "chat.completion" and b["id"] != a["id"]


def test_a_streamed_hit_concatenates_to_the_original_text(
    admin: httpx.Client, api: httpx.Client
) -> None:
    tenant = new_tenant(admin, "stream")
    question = unique(QUESTION)
    original = text_of(ask(api, tenant, question))
    outcome, text = streamed(api, tenant, question)
    assert (outcome, text) == ("exact", original)


def test_no_store_neither_reads_nor_writes_and_no_cache_only_writes(
    admin: httpx.Client, api: httpx.Client
) -> None:
    tenant = new_tenant(admin, "control")
    question = unique(QUESTION)
    assert (
        ask(api, tenant, question, headers={"cache-control": "no-store"}).headers["x-cache"]
        == "bypass"
    )
    assert (
        ask(api, tenant, question, headers={"cache-control": "no-cache"}).headers["x-cache"]
        == "bypass"
    )
    assert ask(api, tenant, question).headers["x-cache"] == "exact"
    assert (
        ask(api, tenant, question, headers={"cache-control": "no-store"}).headers["x-cache"]
        == "bypass"
    )


def test_sampled_requests_are_not_cached(admin: httpx.Client, api: httpx.Client) -> None:
    tenant = new_tenant(admin, "sampled")
    question = unique(QUESTION)
    for _ in range(2):
        assert ask(api, tenant, question, temperature=0.8).headers["x-cache"] == "bypass"
    ask(api, tenant, question, temperature=0.8, seed=5)
    assert ask(api, tenant, question, temperature=0.8, seed=5).headers["x-cache"] == "exact"


def test_tenant_b_never_gets_tenant_a_entry(admin: httpx.Client, api: httpx.Client) -> None:
    """Neither exactly (identical request) nor semantically (a paraphrase); each asks once, as
    every miss stores the asker's own entry."""
    a, b, c = semantic_tenant(admin), semantic_tenant(admin), semantic_tenant(admin)
    system = unique("You answer briefly.")
    ask(api, a, QUESTION, system=system)
    assert ask(api, a, QUESTION, system=system).headers["x-cache"] == "exact"
    assert ask(api, a, PARAPHRASE, system=system).headers["x-cache"] == "semantic"
    assert ask(api, b, QUESTION, system=system).headers["x-cache"] == "miss"
    assert ask(api, c, PARAPHRASE, system=system).headers["x-cache"] == "miss"


def test_a_semantic_hit_carries_its_similarity(admin: httpx.Client, api: httpx.Client) -> None:
    tenant = semantic_tenant(admin)
    system = unique("You answer briefly.")
    original = ask(api, tenant, QUESTION, system=system)
    hit = ask(api, tenant, PARAPHRASE, system=system)
    assert hit.headers["x-cache"] == "semantic"
    assert 0.92 <= float(hit.headers["x-cache-similarity"]) <= 1.0
    assert text_of(hit) == text_of(original)


def test_semantic_hits_need_the_tenant_setting_and_no_refusal_in_the_body(
    admin: httpx.Client, api: httpx.Client
) -> None:
    plain, semantic = new_tenant(admin, "plain"), semantic_tenant(admin)
    system = unique("You answer briefly.")
    for tenant in (plain, semantic):
        ask(api, tenant, QUESTION, system=system)
    assert ask(api, plain, PARAPHRASE, system=system).headers["x-cache"] == "miss"
    refused = ask(api, semantic, PARAPHRASE, system=system, cache={"semantic": False})
    assert refused.headers["x-cache"] == "miss"


def test_close_but_different_questions_are_not_semantic_hits(
    admin: httpx.Client, api: httpx.Client
) -> None:
    tenant = semantic_tenant(admin)
    system = unique("You answer briefly.")
    ask(api, tenant, "Convert 10 miles to kilometers.", system=system)
    for other in ("Convert 10 kilometers to miles.", "Convert 12 miles to kilometers."):
        assert ask(api, tenant, other, system=system).headers["x-cache"] == "miss"


def test_a_reuploaded_adapter_never_serves_the_old_versions_entries(
    admin: httpx.Client, api: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    tenant = new_tenant(admin, "reupload")
    name = f"support-{uuid.uuid4().hex[:6]}"
    upload_adapter(admin, tenant.tenant_id, name, demo_adapter_dirs[0])
    question = unique(QUESTION)
    ask(api, tenant, question, model=name)
    assert ask(api, tenant, question, model=name).headers["x-cache"] == "exact"
    upload_adapter(admin, tenant.tenant_id, name, demo_adapter_dirs[1])
    assert ask(api, tenant, question, model=name).headers["x-cache"] == "miss"


def test_new_base_weights_under_the_same_name_never_replay_the_old_ones_answers(
    demo_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    """An operator upgrades the base model in place: the same served name, database and cache
    Redis, new weights. The new weights' first answers are their own, exact and semantic."""
    upgraded = build_demo_model(tmp_path / "demo-model-v2", seed=1)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    system = unique("You answer briefly.")
    with gateway_server(demo_model_dir, data_dir, redis_url) as old, admin_client(old) as admin:
        tenant = semantic_tenant(admin)
        before = ask(admin, tenant, QUESTION, system=system)
        assert ask(admin, tenant, QUESTION, system=system).headers["x-cache"] == "exact"
        assert ask(admin, tenant, PARAPHRASE, system=system).headers["x-cache"] == "semantic"
    with gateway_server(upgraded, data_dir, redis_url) as new, admin_client(new) as api:
        after = [ask(api, tenant, q, system=system) for q in (QUESTION, PARAPHRASE)]
        own = ask(api, tenant, QUESTION, system=system, headers={"cache-control": "no-store"})
    assert [r.headers["x-cache"] for r in after] == ["miss", "semantic"]
    assert text_of(after[0]) == text_of(after[1]) == text_of(own) != text_of(before)


def test_a_hit_carries_the_fingerprint_its_answer_was_made_under(
    admin: httpx.Client, api: httpx.Client, gateway: RunningServer, redis_url: str
) -> None:
    """Bug: a hit was stamped with this gateway's `system_fingerprint` whichever engine build
    made its answer (the cache keys by the weights, not the build: gateways of two builds share
    it during a rolling upgrade). The entry keeps its maker's fingerprint and a hit replays it."""
    tenant = new_tenant(admin, "fingerprint")
    question = unique(QUESTION)
    made_here = ask(api, tenant, question).json()["system_fingerprint"]
    # As a gateway on another engine build would have written the entry:
    client = redis.Redis.from_url(redis_url)
    scope = glob_escape(gateway.state.cache.keys.scope(tenant.tenant_id))
    [entry] = [k for k in client.scan_iter(match=scope + "*") if Keyspace.is_exact(k.decode())]
    other_build = "fp_0123456789ab"
    client.set(
        entry, json.dumps(json.loads(client.get(entry) or b"") | {"fingerprint": other_build})
    )
    client.close()
    hit = ask(api, tenant, question)
    assert hit.headers["x-cache"] == "exact" and made_here != other_build
    assert hit.json()["system_fingerprint"] == other_build
    auth = {"authorization": f"Bearer {tenant.key}"}
    asked = {"model": "demo-model", "max_tokens": 12, "temperature": 0, "stream": True}
    asked["messages"] = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": question},
    ]
    with api.stream("POST", "/v1/chat/completions", json=asked, headers=auth) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {c["system_fingerprint"] for c in chunks} == {other_build}


def test_cache_settings_are_validated_and_read_back(admin: httpx.Client) -> None:
    tenant = new_tenant(admin, "settings")
    path = f"/admin/tenants/{tenant.tenant_id}/cache"
    assert json_of(admin.get(path))["semantic"] is False
    updated = json_of(admin.put(path, json={"semantic": True, "threshold": 0.95, "ttl": 60}))
    assert (updated["semantic"], updated["threshold"], updated["ttl"]) == (True, 0.95, 60)
    assert updated["verifier"] == "strict" and updated["enabled"] is True
    for bad in ({"threshold": 1.5}, {"ttl": 0}, {"verifier": "lenient"}, {"semantc": True}):
        assert admin.put(path, json=bad).status_code == 400, bad
    assert json_of(admin.get(path)) == updated
    assert admin.get("/admin/tenants/tnt_missing/cache").status_code == 404


def test_purge_removes_a_tenants_entries_and_is_audited(
    admin: httpx.Client, api: httpx.Client
) -> None:
    tenant, other = new_tenant(admin, "purge"), new_tenant(admin, "kept")
    question = unique(QUESTION)
    for t in (tenant, other):
        ask(api, t, question)
    purged = admin.delete("/admin/cache", params={"tenant": tenant.tenant_id, "adapter": "base"})
    assert json_of(purged) == {"purged": 1}
    assert ask(api, tenant, question).headers["x-cache"] == "miss"
    assert ask(api, other, question).headers["x-cache"] == "exact"
    assert json_of(admin.delete("/admin/cache", params={"tenant": tenant.tenant_id})) == {
        "purged": 1
    }
    entry = json_of(admin.get("/admin/audit", params={"limit": 1}))["items"][0]
    assert (entry["action"], entry["target"], entry["outcome"]) == (
        "cache.purge",
        tenant.tenant_id,
        "ok",
    )
    assert entry["detail"]["purged"] == 1
    assert (
        admin.delete(
            "/admin/cache", params={"tenant": tenant.tenant_id, "adapter": "x/none"}
        ).status_code
        == 404
    )
    assert admin.delete("/admin/cache").status_code == 400


def test_a_redis_restart_fails_no_request_and_caching_resumes(
    admin: httpx.Client, api: httpx.Client, redis_server: RedisServer
) -> None:
    tenant = new_tenant(admin, "restart")
    question = unique(QUESTION)
    ask(api, tenant, question)
    assert ask(api, tenant, question).headers["x-cache"] == "exact"
    redis_server.restart()
    assert ask(api, tenant, question).headers["x-cache"] == "miss"
    assert ask(api, tenant, question).headers["x-cache"] == "exact"


def _streamed_pieces(api: httpx.Client, tenant: TenantKey, question: str) -> tuple[str, list[str]]:
    """(x-cache, the content pieces) of a streamed request."""
    body = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {tenant.key}"}
    with api.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        outcome = r.headers["x-cache"]
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    return outcome, [p for p in pieces if p]


@pytest.mark.parametrize(("pacing", "paced"), [("instant", False), ("paced", True)])
def test_a_streamed_hit_is_sent_at_once_or_paced_as_the_tenant_says(
    admin: httpx.Client, api: httpx.Client, pacing: str, paced: bool
) -> None:
    tenant = semantic_tenant(admin, hit_pacing=pacing, hit_tokens_per_second=10_000)
    question = unique("Tell me about the sea")
    first, generated = _streamed_pieces(api, tenant, question)
    again, replayed = _streamed_pieces(api, tenant, question)
    assert (first, again) == ("miss", "exact")
    assert "".join(replayed) == "".join(generated)
    # paced: a piece per completion token, as it was generated; instant: the whole text at once
    assert len(generated) > 1
    assert (len(replayed) > 1) if paced else (len(replayed) == 1)


def test_a_request_without_max_tokens_hits_and_a_refused_one_counts_no_lookup(
    admin: httpx.Client, api: httpx.Client
) -> None:
    """Keyed by the max_tokens the prompt's length derives; a request refused before the
    lookup (its prompt is over the context) counts no lookup."""
    tenant = new_tenant(admin, "derived")
    question = unique(QUESTION)
    first = ask(api, tenant, question, max_tokens=None)
    second = ask(api, tenant, question, max_tokens=None)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "exact")
    assert text_of(second) == text_of(first)
    assert ask(api, tenant, question, max_tokens=3).headers["x-cache"] == "miss"
    auth = {"authorization": f"Bearer {tenant.key}"}
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "word " * 2000}]}
    refused = api.post("/v1/chat/completions", json=body | {"temperature": 0}, headers=auth)
    assert refused.status_code == 400, refused.text
    stats = json_of(admin.get(f"/admin/tenants/{tenant.tenant_id}/cache/stats"))
    assert (stats["lookups"], stats["exact_hits"], stats["misses"]) == (3, 1, 2)


def test_cache_settings_of_a_tenant_deleted_meanwhile_are_404(each_gateway: RunningServer) -> None:
    """The settings' UPDATE of a tenant the delete removed after it was read matched no row
    (StaleDataError): a 500."""
    gateway = each_gateway
    tenant = new_tenant(admin_client(gateway), "settings")

    def update(session: AsyncSession) -> Any:
        cache_admin = CacheAdmin(session, gateway.state.keys, gateway.state.cache)
        return cache_admin.update_settings(tenant.tenant_id, {"semantic": True})

    outcome = gateway.run(after_its_delete(gateway.state, tenant.tenant_id, update))

    assert outcome == "404 tenant_not_found"
