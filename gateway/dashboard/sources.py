"""What the dashboard reads, composed once from the process's state where the app is built
(`dashboard_router`): the routes take `DashboardSources` through Litestar's `Provide`, and the
views and the session code never see the gateway's whole state."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.cache.response_cache import ResponseCache
from loramux.gateway.audit.service import AuditLog
from loramux.gateway.auth.admin_jwt import AdminAuth
from loramux.gateway.auth.api_keys import ApiKeyAuth
from loramux.gateway.engine_client.base import EngineClient
from loramux.gateway.state import GatewayState, admin_secret


@dataclass(frozen=True)
class DashboardSources:
    sessions: async_sessionmaker[AsyncSession]
    redis: Redis
    """The quota Redis: the live panel reads the limiter's buckets."""
    redis_timeout: float
    """Seconds a read of the quota Redis may take (the quota service's own timeout,
    LORAMUX_QUOTA_REDIS_TIMEOUT_MS): a silent Redis must not hold the page."""
    engine: EngineClient
    keys: ApiKeyAuth
    admin: AdminAuth
    model_name: str
    admin_secret: str
    """Signs dashboard sessions (through a derived key, `gateway.dashboard.session`)."""
    cache: ResponseCache
    """The response cache: its per-tenant counts (hits, near misses, refusals, wrong hits)."""
    audit: AuditLog
    """Where a refused admin token is recorded, as the admin API's guard records one."""

    @classmethod
    def of(cls, gw: GatewayState) -> DashboardSources:
        return cls(
            gw.sessions,
            gw.redis,
            gw.quotas.timeout,
            gw.engine,
            gw.keys,
            gw.admin,
            gw.model_name,
            admin_secret(gw.settings),
            gw.cache,
            AuditLog(gw.sessions),
        )
