"""Routes: the audit log (`/admin/audit`)."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import QueryParameter

from gateway.admin.wire import utc
from gateway.api_docs import admin_errors
from gateway.audit.schemas import AuditOut
from gateway.audit.service import AuditLog


class AuditController(Controller):
    path = "/audit"
    tags = ("admin: audit",)

    @get(responses=admin_errors(400))
    async def audit_log(
        self,
        audit_log: NamedDependency[AuditLog],
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
    ) -> list[AuditOut]:
        """The newest audit entries first."""
        rows = await audit_log.recent(limit)
        return [
            AuditOut(r.id, utc(r.created_at), r.actor, r.action, r.target, r.outcome, r.detail)
            for r in rows
        ]
