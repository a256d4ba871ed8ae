"""Routes: usage summaries (`/admin/usage`)."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery, QueryParameter

from loramux.gateway.api_docs import admin_errors
from loramux.gateway.usage.schemas import UsageReport
from loramux.gateway.usage.service import GroupBy, UsageReports, parse_query


class UsageController(Controller):
    path = "/usage"
    tags = ("admin: usage",)

    @get(responses=admin_errors(400))
    async def usage(
        self,
        usage_reports: NamedDependency[UsageReports],
        tenant: FromQuery[str | None] = None,
        start: Annotated[str | None, QueryParameter(name="from")] = None,
        end: Annotated[str | None, QueryParameter(name="to")] = None,
        group_by: FromQuery[GroupBy] = "day",
    ) -> UsageReport:
        """Requests, tokens, cache hits, errors and mean latency per day (UTC), adapter or key,
        for one tenant or all. `from` (inclusive) and `to` (exclusive; a date includes the
        whole day) are ISO dates or times."""
        return await usage_reports.summarize(parse_query(tenant, start, end, group_by))
