"""Quotas: rate limits, concurrency and token budgets per tenant and per key, enforced by one
atomic Redis script per request (see gateway.quotas.service)."""

from loramux.gateway.quotas.admission import Admission
from loramux.gateway.quotas.service import QuotaService

__all__ = ["Admission", "QuotaService"]
