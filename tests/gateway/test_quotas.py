"""Quotas through the real gateway and the `openai` client: successful responses carry OpenAI's
`x-ratelimit-*` headers, a refused request is a 429 the client raises as RateLimitError (with
`retry-after`, streaming requests included, before the first byte), and the tokens left after a
request are what its real usage implies."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from loramux.gateway.db import UsageEvent
from loramux.gateway.server import RunningServer
from tests.gateway.tenants import TenantKey, new_tenant

MESSAGES = [{"role": "user", "content": "Say something short."}]
NO_CACHE = {"cache-control": "no-store"}
"""Every request here reaches the engine (a cache hit would count no tokens)."""


def chat(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model": "demo-model",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def limited(admin: httpx.Client, **quota: Any) -> TenantKey:
    """A new tenant whose key has the given quotas."""
    tenant = new_tenant(admin, "quota")
    r = admin.put(f"/admin/keys/{tenant.key_id}/quotas", json=quota)
    assert r.status_code == 200, r.text
    return tenant


def post(gateway: RunningServer, tenant: TenantKey, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {tenant.key}", **NO_CACHE},
        timeout=60,
    )


def client(gateway: RunningServer, tenant: TenantKey) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key=tenant.key,
        max_retries=0,
        timeout=60,
        default_headers=NO_CACHE,
    )


def test_successful_responses_carry_rate_limit_headers(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = limited(admin, rpm=5, tpm=100_000)
    r = post(gateway, tenant, chat())
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-limit-requests"] == "5"
    assert r.headers["x-ratelimit-remaining-requests"] == "4"
    assert r.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert r.headers["x-ratelimit-limit-tokens"] == "100000"
    prompt = r.json()["usage"]["prompt_tokens"]
    assert r.headers["x-ratelimit-remaining-tokens"] == str(100_000 - prompt - 4)


def test_remaining_tokens_follow_the_real_usage(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = limited(admin, tpm=10_000)
    first = post(gateway, tenant, chat(max_tokens=40))
    used = first.json()["usage"]["total_tokens"]
    second = post(gateway, tenant, chat(max_tokens=40))
    prompt = second.json()["usage"]["prompt_tokens"]
    # the first request now counts for what it used; the second for its reservation
    assert second.headers["x-ratelimit-remaining-tokens"] == str(10_000 - used - prompt - 40)


def test_the_openai_client_raises_rate_limit_error_with_retry_after(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = limited(admin, rpm=1)
    c = client(gateway, tenant)
    c.chat.completions.create(**chat())
    with pytest.raises(openai.RateLimitError) as caught:
        c.chat.completions.create(**chat())
    err = caught.value
    assert err.status_code == 429
    assert err.code == "rate_limit_exceeded" and err.type == "requests"
    assert 1 <= int(err.response.headers["retry-after"]) <= 60
    assert err.response.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_streaming_request_is_refused_before_the_first_byte(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = limited(admin, rpm=1)
    c = client(gateway, tenant)
    assert list(c.chat.completions.create(**chat(), stream=True))
    with pytest.raises(openai.RateLimitError) as caught:
        c.chat.completions.create(**chat(), stream=True)
    assert caught.value.type == "requests"
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json=chat(stream=True),
        headers={"authorization": f"Bearer {tenant.key}", **NO_CACHE},
        timeout=60,
    ) as r:
        assert r.status_code == 429
        assert r.headers["content-type"].startswith("application/json")
        assert r.headers["retry-after"].isdigit()
        assert b"data:" not in r.read()
        assert r.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_request_larger_than_the_token_limit_is_not_worth_retrying(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = limited(admin, tpm=50)
    with pytest.raises(openai.RateLimitError) as caught:
        client(gateway, tenant).chat.completions.create(**chat(max_tokens=100), stream=True)
    assert caught.value.type == "tokens"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in caught.value.response.headers


def test_a_spent_budget_is_insufficient_quota(gateway: RunningServer, admin: httpx.Client) -> None:
    tenant = limited(admin, token_budget=60, budget_period="month")
    c = client(gateway, tenant)
    with pytest.raises(openai.RateLimitError) as caught:
        c.chat.completions.create(**chat(max_tokens=100))
    assert caught.value.code == "insufficient_quota"
    assert caught.value.type == "insufficient_quota"
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_a_finished_stream_frees_its_concurrency_slot(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = limited(admin, max_concurrent=1)
    c = client(gateway, tenant)
    for _ in range(3):
        chunks = list(c.chat.completions.create(**chat(), stream=True))
        assert chunks


def test_a_usage_event_records_when_its_request_was_admitted(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """Budgets count an event in the period of its admission (see gateway.quotas.ledger)."""
    tenant = limited(admin, token_budget=10_000, budget_period="day")
    assert post(gateway, tenant, chat()).status_code == 200
    gateway.run(gateway.state.usage.flush())

    async def event() -> UsageEvent:
        async with gateway.state.sessions() as session:
            query = select(UsageEvent).where(UsageEvent.tenant_id == tenant.tenant_id)
            return (await session.scalars(query)).one()

    row = gateway.run(event())
    assert row.admitted_at is not None and row.admitted_at <= row.created_at
    assert row.created_at - row.admitted_at < timedelta(seconds=60)
