"""Refusals known before tokenizing (gateway.quotas.early): once its requests-per-minute limit
refused a principal, the gateway refuses its requests at once until the window frees a slot,
with the admission script's 429, and forgets as soon as the limits change. Token limits are
not remembered. Through the gateway, such a request is refused before its prompt is tokenized."""

from __future__ import annotations

from pathlib import Path

import httpx
from sqlalchemy import update

from loramux.gateway.db import Quota
from loramux.gateway.errors import RateLimited
from loramux.gateway.server import RunningServer
from tests.gateway.quotas.rig import QuotaRig, refusal
from tests.gateway.tenants import new_tenant
from tests.redis import RedisServer


async def test_a_principal_refused_for_requests_per_minute_is_refused_at_once_until_a_slot_frees(
    rig: QuotaRig,
) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"rpm": 1})
    await svc.refuse_early(p)  # nothing known yet
    await svc.admit(p, 10, 10)
    by_script = await refusal(svc.admit(p, 10, 10))
    early = await refusal(svc.refuse_early(p))  # type: ignore[arg-type]
    assert isinstance(early, RateLimited) and early.limit_type == "requests"
    assert (early.status, early.code, early.message) == (429, by_script.code, by_script.message)
    assert early.headers["retry-after"] == by_script.headers["retry-after"] == "60"
    assert early.headers["x-ratelimit-remaining-requests"] == "0"
    rig.clock.advance(59.5)
    assert (await refusal(svc.refuse_early(p))).headers["retry-after"] == "1"  # type: ignore[arg-type]
    rig.clock.advance(0.5)
    await svc.refuse_early(p)  # the first request left the window
    await svc.admit(p, 10, 10)


async def test_what_was_known_is_dropped_once_the_limits_change(rig: QuotaRig) -> None:
    svc = rig.service()  # quota rows are read again on every admission here
    p = await rig.principal(tenant={"rpm": 1})
    await svc.admit(p, 10, 10)
    await refusal(svc.admit(p, 10, 10))
    async with rig.sessions() as s:
        await s.execute(update(Quota).where(Quota.tenant_id == p.tenant_id).values(rpm=5))
        await s.commit()
    await svc.refuse_early(p)
    await svc.admit(p, 10, 10)


async def test_a_limit_of_zero_refuses_until_the_limits_change(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(key={"rpm": 0})
    await refusal(svc.admit(p, 10, 10))
    rig.clock.advance(3600)
    early = await refusal(svc.refuse_early(p))  # type: ignore[arg-type]
    assert early.headers.get("x-should-retry") == "false"


async def test_a_token_limit_refusal_is_not_remembered(rig: QuotaRig) -> None:
    """A smaller request may fit where a larger one did not."""
    svc = rig.service()
    p = await rig.principal(tenant={"tpm": 100})
    await refusal(svc.admit(p, 60, 60))
    await svc.refuse_early(p)
    await svc.admit(p, 10, 10)


async def test_an_early_refusal_carries_the_rate_limit_headers_the_scripts_does(
    rig: QuotaRig,
) -> None:
    """Tokens per minute included (counted down); the type and retry-after stay the requests'."""
    svc = rig.service()
    p = await rig.principal(tenant={"rpm": 1, "tpm": 10_000})
    await svc.admit(p, 10, 10)
    by_script = await refusal(svc.admit(p, 10, 10))
    early = await refusal(svc.refuse_early(p))  # type: ignore[arg-type]
    assert isinstance(early, RateLimited) and early.limit_type == "requests"
    assert early.headers == by_script.headers


async def test_what_was_known_goes_when_redis_may_have_lost_its_windows(
    rig: QuotaRig, own_redis: RedisServer
) -> None:
    """A Redis restart without persistence empties every window: the admission script admits
    the principal at once, and so does this gateway once it meets the new Redis."""
    svc = rig.service(own_redis.url)
    p = await rig.principal(tenant={"rpm": 1})
    other = await rig.principal(tenant={"rpm": 100})
    await svc.admit(p, 10, 10)
    await refusal(svc.admit(p, 10, 10))
    own_redis.restart()
    await svc.admit(other, 10, 10)  # a pooled connection fails once: reconnected
    await svc.refuse_early(p)
    await svc.admit(p, 10, 10)


def test_through_the_gateway_such_a_request_is_refused_before_its_prompt_is_tokenized(
    gateway: RunningServer, admin: httpx.Client, tmp_path: Path
) -> None:
    """The third request's prompt is far over the context: tokenized, it would be a 400."""
    tenant = new_tenant(admin, "early")
    r = admin.put(f"/admin/tenants/{tenant.tenant_id}/quotas", json={"rpm": 1})
    assert r.status_code == 200, r.text
    auth = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}

    def chat(content: str) -> httpx.Response:
        body = {"model": "demo-model", "messages": [{"role": "user", "content": content}]}
        return httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json=body | {"max_tokens": 2},
            headers=auth,
            timeout=60,
        )

    assert chat("hi").status_code == 200
    by_admission = chat("hi")
    assert by_admission.status_code == 429, by_admission.text
    early = chat("word " * 2000)
    assert early.status_code == 429, early.text
    assert early.json()["error"]["type"] == "requests"
    assert early.headers["x-ratelimit-limit-requests"] == "1"
