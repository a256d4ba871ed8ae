"""Routes: the audit log (`/admin/audit`)."""

from __future__ import annotations

from litestar import Controller, get
from litestar.di import NamedDependency

from loramux.gateway.admin.paging import Paging
from loramux.gateway.admin.wire import utc
from loramux.gateway.api_docs import admin_errors
from loramux.gateway.audit.schemas import AuditOut, AuditPage
from loramux.gateway.audit.service import AuditLog


class AuditController(Controller):
    path = "/audit"
    tags = ("admin: audit",)

    @get(responses=admin_errors(400))
    async def audit_log(
        self, audit_log: NamedDependency[AuditLog], paging: NamedDependency[Paging]
    ) -> AuditPage:
        """Audit entries, newest first, a page at a time; `name` keeps entries whose target
        (a tenant, key or adapter) holds it."""
        rows, total = await audit_log.recent(paging)
        items = [
            AuditOut(r.id, utc(r.created_at), r.actor, r.action, r.target, r.outcome, r.detail)
            for r in rows
        ]
        return AuditPage(items, total, paging.limit, paging.offset)
