"""Helpers of the quota tests: a clock the test moves, tenants with quota rows, services."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.db import ApiKey, Quota, Tenant, UsageEvent
from loramux.gateway.errors import GatewayError
from loramux.gateway.quotas import Admission, QuotaService
from loramux.gateway.settings import QuotaSettings
from loramux.gateway.usage import UsageRecorder


class Clock:
    """Seconds since the epoch; moves only when told to."""

    def __init__(self, now: float | None = None):
        self.now = float(int(time.time())) if now is None else now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def settings(**overrides: Any) -> QuotaSettings:
    values: dict[str, Any] = {
        "on_redis_down": "reject",
        "redis_timeout_ms": 10_000,
        "config_cache_seconds": 0.0,
        "slot_lease_seconds": 30.0,
    }
    return QuotaSettings(**(values | overrides))


def redis_client(url: str) -> Redis:
    """A client whose commands wait for a free pooled connection (the default pool refuses
    past 100 connections in use, which 250 concurrent admissions exceed)."""
    return Redis(connection_pool=BlockingConnectionPool.from_url(url, max_connections=50))


@dataclass
class QuotaRig:
    """Makes tenants with quotas and QuotaServices over one Redis and one database."""

    redis_url: str
    sessions: async_sessionmaker[AsyncSession]
    clock: Clock
    services: list[QuotaService]

    def service(
        self, redis_url: str | None = None, usage: UsageRecorder | None = None, **overrides: Any
    ) -> QuotaService:
        """A service over `redis_url` (the rig's Redis by default), with the settings' overrides;
        `usage`: the process's usage recorder, whose unwritten events ledgers count."""
        redis = redis_client(redis_url or self.redis_url)
        svc = QuotaService(
            redis, self.sessions, settings(**overrides), clock=self.clock, usage=usage
        )
        self.services.append(svc)
        return svc

    async def principal(
        self, tenant: dict[str, Any] | None = None, key: dict[str, Any] | None = None
    ) -> Principal:
        """A new tenant and key with the given quota rows (None: no row)."""
        key_id = uuid.uuid4().hex[:12]
        async with self.sessions() as s:
            t = Tenant(name=f"quota-{uuid.uuid4().hex[:10]}")
            s.add(t)
            await s.flush()
            s.add(ApiKey(id=key_id, tenant_id=t.id, secret_hash="0" * 64))
            await s.flush()
            if tenant is not None:
                s.add(Quota(tenant_id=t.id, key_id=None, **tenant))
            if key is not None:
                s.add(Quota(tenant_id=t.id, key_id=key_id, **key))
            await s.commit()
            return Principal(t.id, t.name, key_id, None, {})

    async def add_usage(
        self, p: Principal, key_id: str, tokens: int, at: datetime | None = None
    ) -> None:
        """A usage event of `tokens` billable tokens (at the clock's time by default)."""
        created = at or datetime.fromtimestamp(self.clock(), UTC)
        async with self.sessions() as s:
            s.add(
                UsageEvent(
                    created_at=created,
                    request_id="quota-test",
                    tenant_id=p.tenant_id,
                    key_id=key_id,
                    model="m",
                    prompt_tokens=tokens // 2,
                    completion_tokens=tokens - tokens // 2,
                    status=200,
                )
            )
            await s.commit()


async def refusal(admit: Awaitable[Admission]) -> GatewayError:
    """The error an admission raised (it must raise one)."""
    try:
        await admit
    except GatewayError as exc:
        return exc
    raise AssertionError("the request was admitted")


async def remaining_tokens(svc: QuotaService, p: Principal) -> int:
    """Tokens left per minute, read by a request that reserves none (counted as one request)."""
    admission = await svc.admit(p, 0, 0)
    await admission.settle(0)
    return int(admission.headers["x-ratelimit-remaining-tokens"])
