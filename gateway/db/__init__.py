"""SQLAlchemy models (one per module) and the async session factory."""

from gateway.db.adapter import AdapterVersion
from gateway.db.api_key import ApiKey
from gateway.db.audit import AuditEntry
from gateway.db.base import Base
from gateway.db.quota import Quota
from gateway.db.tenant import Tenant
from gateway.db.usage import UsageEvent
from gateway.db.usage_rollup import UsageTotals, usage_daily, usage_hourly

__all__ = [
    "AdapterVersion",
    "ApiKey",
    "AuditEntry",
    "Base",
    "Quota",
    "Tenant",
    "UsageEvent",
    "UsageTotals",
    "usage_daily",
    "usage_hourly",
]
