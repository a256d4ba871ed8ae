"""SQLAlchemy models (one per module) and the async session factory."""

from loramux.gateway.db.adapter import AdapterVersion
from loramux.gateway.db.adapter_file import AdapterFilePart
from loramux.gateway.db.api_key import ApiKey
from loramux.gateway.db.audit import AuditEntry
from loramux.gateway.db.base import Base
from loramux.gateway.db.first_start import FirstStart
from loramux.gateway.db.quota import Quota
from loramux.gateway.db.tenant import Tenant
from loramux.gateway.db.usage import UsageEvent
from loramux.gateway.db.usage_rollup import UsageTotals, usage_daily, usage_hourly

__all__ = [
    "AdapterFilePart",
    "AdapterVersion",
    "ApiKey",
    "AuditEntry",
    "Base",
    "FirstStart",
    "Quota",
    "Tenant",
    "UsageEvent",
    "UsageTotals",
    "usage_daily",
    "usage_hourly",
]
