"""Semantic hits through the gateway: paraphrases of each kind hit, every change that changes the
answer misses, a wrong hit reported by request id is invalidated (and only by its own tenant's
report), the tenant's counts and a threshold tuned from its own labelled pairs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.conftest import json_of
from tests.gateway.tenants import TenantKey, new_tenant, upload_adapter
from tests.gateway.test_dashboard import signed_in

PARAPHRASES = {
    "synonym": ("How do I cancel my subscription?", "How do I terminate my subscription?"),
    "voice change": ("Who approves my refund request?", "By whom is my refund request approved?"),
    "reordered clause": (
        "When my order ships, will I get a tracking number?",
        "Will I get a tracking number when my order ships?",
    ),
    "question / imperative": ("How do I reset my password?", "Tell me how to reset my password."),
}

STORED = "How do I transfer money from savings to checking in Germany within 3 days?"
MISSES = {
    "number": "How do I transfer money from savings to checking in Germany within 5 days?",
    "entity": "How do I transfer money from savings to checking in France within 3 days?",
    "negation": "Why can't I transfer money from savings to checking in Germany within 3 days?",
    "antonym": "How do I withdraw money from savings to checking in Germany within 3 days?",
    "reversed relation": (
        "How do I transfer money from checking to savings in Germany within 3 days?"
    ),
    "qualifier": (
        "How do I transfer money from joint savings to checking in Germany within 3 days?"
    ),
}


@pytest.fixture
def api(gateway: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=120) as c:
        yield c


def semantic_tenant(admin: httpx.Client) -> TenantKey:
    tenant = new_tenant(admin, "semantic")
    r = admin.put(f"/admin/tenants/{tenant.tenant_id}/cache", json={"semantic": True})
    assert r.status_code == 200, r.text
    return tenant


def ask(
    api: httpx.Client,
    tenant: TenantKey,
    content: str,
    *,
    history: list[dict[str, str]] | None = None,
    model: str = "demo-model",
) -> httpx.Response:
    messages = [{"role": "system", "content": "You answer briefly."}, *(history or [])]
    body: dict[str, Any] = {
        "model": model,
        "messages": [*messages, {"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = api.post(
        "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {tenant.key}"}
    )
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("kind", PARAPHRASES)
def test_a_paraphrase_of_each_kind_is_a_semantic_hit(
    kind: str, admin: httpx.Client, api: httpx.Client
) -> None:
    tenant = semantic_tenant(admin)
    stored, asked = PARAPHRASES[kind]
    original = ask(api, tenant, stored)
    hit = ask(api, tenant, asked)
    assert hit.headers["x-cache"] == "semantic"
    assert hit.json()["choices"][0]["message"] == original.json()["choices"][0]["message"]


def test_a_semantic_hit_reports_its_own_prompts_tokens(
    admin: httpx.Client, api: httpx.Client
) -> None:
    """The answer is another prompt's, but `usage.prompt_tokens` is this request's prompt, in a
    whole response and in a stream's usage chunk (it reported the cached prompt's: found by
    attacking billing)."""
    stored, asked = PARAPHRASES["question / imperative"]
    own = ask(api, new_tenant(admin, "plain"), asked).json()["usage"]["prompt_tokens"]
    tenant = semantic_tenant(admin)
    assert ask(api, tenant, stored).json()["usage"]["prompt_tokens"] != own
    hit = ask(api, tenant, asked)
    assert hit.headers["x-cache"] == "semantic"
    assert hit.json()["usage"]["prompt_tokens"] == own
    body = {
        "model": "demo-model",
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": asked},
        ],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {tenant.key}"}
    with api.stream("POST", "/v1/chat/completions", json=body, headers=headers) as streamed:
        assert streamed.headers["x-cache"] == "semantic"
        chunks = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert json.loads(chunks[-1].removeprefix("data: "))["usage"]["prompt_tokens"] == own


def test_every_change_that_changes_the_answer_misses(
    admin: httpx.Client, api: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    tenant, other_tenant = semantic_tenant(admin), semantic_tenant(admin)
    adapter = f"bank-{uuid.uuid4().hex[:6]}"
    upload_adapter(admin, tenant.tenant_id, adapter, demo_adapter_dirs[0])
    ask(api, tenant, STORED)
    ask(api, tenant, STORED, model=adapter)
    assert ask(api, tenant, STORED).headers["x-cache"] == "exact"
    outcomes = {kind: ask(api, tenant, q).headers["x-cache"] for kind, q in MISSES.items()}
    earlier = [
        {"role": "user", "content": "I bank with N26."},
        {"role": "assistant", "content": "OK."},
    ]
    outcomes["other earlier conversation"] = ask(api, tenant, STORED, history=earlier).headers[
        "x-cache"
    ]
    outcomes["other tenant"] = ask(api, other_tenant, STORED).headers["x-cache"]
    upload_adapter(admin, tenant.tenant_id, adapter, demo_adapter_dirs[1])  # a new digest
    outcomes["other adapter digest"] = ask(api, tenant, STORED, model=adapter).headers["x-cache"]
    assert outcomes == dict.fromkeys(outcomes, "miss")
    stats = json_of(admin.get(f"/admin/tenants/{tenant.tenant_id}/cache/stats"))
    assert stats["exact_hits"] == 1 and stats["semantic_hits"] == 0
    assert sum(stats["refusals"].values()) >= len(MISSES) - 1


def test_a_reported_wrong_hit_is_invalidated_and_the_next_identical_request_misses(
    gateway: RunningServer, admin: httpx.Client, api: httpx.Client
) -> None:
    tenant = semantic_tenant(admin)
    stored, asked = PARAPHRASES["synonym"]
    ask(api, tenant, stored)
    hit = ask(api, tenant, asked)
    assert hit.headers["x-cache"] == "semantic"
    report = {"tenant": tenant.tenant_id, "request_id": hit.headers["x-request-id"]}
    assert json_of(admin.post("/admin/cache/feedback", json=report)) == {"invalidated": True}
    assert ask(api, tenant, asked).headers["x-cache"] == "miss"
    # The same report again: the entry is gone, and the record with it.
    assert admin.post("/admin/cache/feedback", json=report).status_code == 404
    stats = json_of(admin.get(f"/admin/tenants/{tenant.tenant_id}/cache/stats"))
    assert stats["wrong_hits"] == 1 and stats["semantic_hits"] == 1
    # ... and the tenant's dashboard shows it
    with signed_in(gateway, tenant.key) as dashboard:
        page = dashboard.get("/dashboard", params={"paused": "true"}).text
    assert 'data-testid="cache-wrong-hits">1<' in page
    assert 'data-testid="cache-hits">0 / 1<' in page


def test_a_wrong_hit_is_reported_by_the_tenants_name_as_by_its_id(
    admin: httpx.Client, api: httpx.Client
) -> None:
    """The admin API takes a tenant by id or name everywhere: feedback by name found no record
    (404) and counted nothing, as it looked the name up as an id."""
    tenant = new_tenant(admin, "named")
    question = f"Where do I change my billing address? {uuid.uuid4().hex[:6]}"
    ask(api, tenant, question)
    served = ask(api, tenant, question)
    assert served.headers["x-cache"] == "exact"
    report = {"tenant": tenant.tenant_name, "request_id": served.headers["x-request-id"]}
    assert json_of(admin.post("/admin/cache/feedback", json=report)) == {"invalidated": True}
    stats = json_of(admin.get(f"/admin/tenants/{tenant.tenant_name}/cache/stats"))
    assert (stats["tenant_id"], stats["wrong_hits"], stats["exact_hits"]) == (
        tenant.tenant_id,
        1,
        1,
    )


def test_another_tenant_cannot_report_a_tenants_response(
    admin: httpx.Client, api: httpx.Client
) -> None:
    owner, other = semantic_tenant(admin), semantic_tenant(admin)
    question = f"How do I export my invoices? {uuid.uuid4().hex[:6]}"
    ask(api, owner, question)
    served = ask(api, owner, question)
    request_id = served.headers["x-request-id"]
    foreign = admin.post(
        "/admin/cache/feedback", json={"tenant": other.tenant_id, "request_id": request_id}
    )
    unknown = admin.post(
        "/admin/cache/feedback", json={"tenant": other.tenant_id, "request_id": "req_nothing"}
    )
    assert foreign.status_code == unknown.status_code == 404
    assert json_of(foreign)["error"]["message"] == json_of(unknown)["error"]["message"]
    assert ask(api, owner, question).headers["x-cache"] == "exact"
    hostile = {"tenant": other.tenant_id, "request_id": "r" * 10_000}
    assert admin.post("/admin/cache/feedback", json=hostile).status_code == 400
    for bad in (
        {"tenant": other.tenant_id},
        {"request_id": "x"},
        {"tenant": "", "request_id": "x"},
    ):
        assert admin.post("/admin/cache/feedback", json=bad).status_code == 400, bad


def test_a_tenants_threshold_is_set_from_its_labelled_pairs(
    admin: httpx.Client,
) -> None:
    tenant = semantic_tenant(admin)
    pairs = [{"a": a, "b": b, "same": True} for a, b in PARAPHRASES.values()] + [
        {"a": STORED, "b": q, "same": False} for q in MISSES.values()
    ]
    path = f"/admin/tenants/{tenant.tenant_id}/cache/threshold"
    tuned = json_of(admin.post(path, json={"pairs": pairs, "objective": "f1"}))
    assert 0.5 <= tuned["threshold"] <= 1.0 and tuned["pairs"] == len(pairs)
    assert tuned["precision"] == 1.0 and tuned["recall"] == 1.0
    settings = json_of(admin.get(f"/admin/tenants/{tenant.tenant_id}/cache"))
    assert settings["threshold"] == tuned["threshold"]
    only_different = [p for p in pairs if not p["same"]]
    assert admin.post(path, json={"pairs": only_different}).status_code == 422
    assert admin.post(path, json={"pairs": pairs[:1]}).status_code == 400
    assert (
        admin.post("/admin/tenants/tnt_missing/cache/threshold", json={"pairs": pairs}).status_code
        == 404
    )
