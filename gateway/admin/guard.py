"""The guard of the admin router: a valid admin JWT, else 401 and an audit entry for the refused
token (actor `anonymous`, action `admin.auth`, target the method and path)."""

from __future__ import annotations

from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.types import Guard

from loramux.gateway.audit.action import IDENTITY
from loramux.gateway.audit.service import AuditLog
from loramux.gateway.auth.admin_jwt import AdminAuth
from loramux.gateway.errors import GatewayError

ANONYMOUS = "anonymous"


def admin_guard(auth: AdminAuth, audit_log: AuditLog) -> Guard:
    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        try:
            identity = auth.verify(connection.headers.get("authorization"))
        except GatewayError as exc:
            target = f"{connection.scope.get('method', 'GET')} {connection.url.path}"
            detail = {"error": exc.message[:500]}
            await audit_log.write(ANONYMOUS, "admin.auth", target, exc.code or "denied", detail)
            raise
        connection.state[IDENTITY] = identity

    return guard
