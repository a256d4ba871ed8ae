"""Routes: usage summaries (`/admin/usage`) and the audit log (`/admin/audit`)."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery, QueryParameter

from gateway.admin import usage_service
from gateway.admin.schemas import AuditOut, UsageReport, utc
from gateway.audit import recent_entries
from gateway.auth.admin_jwt import AdminIdentity
from gateway.state import GatewayState


class ReportController(Controller):
    path = "/"
    tags = ("admin: usage",)

    @get("/usage")
    async def usage(
        self,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
        tenant: FromQuery[str | None] = None,
        start: Annotated[str | None, QueryParameter(name="from")] = None,
        end: Annotated[str | None, QueryParameter(name="to")] = None,
        group_by: FromQuery[str] = "day",
    ) -> UsageReport:
        """Requests, tokens, cache hits, errors and mean latency per day (UTC), adapter or key,
        for one tenant or all. `from` (inclusive) and `to` (exclusive; a date includes the
        whole day) are ISO dates or times."""
        query = usage_service.parse_query(tenant, start, end, group_by)
        return await usage_service.summarize(gw, query)

    @get("/audit")
    async def audit_log(
        self,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
    ) -> list[AuditOut]:
        """The newest audit entries first."""
        rows = await recent_entries(gw, limit)
        return [
            AuditOut(r.id, utc(r.created_at), r.actor, r.action, r.target, r.outcome, r.detail)
            for r in rows
        ]
