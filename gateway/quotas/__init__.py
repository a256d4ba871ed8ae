"""Quotas: rate limits, concurrency and token budgets per tenant and per key, enforced by one
atomic Redis script per request (see gateway.quotas.service)."""

from gateway.quotas.admission import Admission
from gateway.quotas.service import QuotaService

__all__ = ["Admission", "QuotaService"]
