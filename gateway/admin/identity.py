"""The `admin_identity` dependency of the admin routes: the app's check, plus an audit entry for
every refused token (actor `anonymous`, action `admin.auth`, target the method and path)."""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.di import NamedDependency

from gateway.audit import write_entry
from gateway.auth.admin_jwt import AdminIdentity
from gateway.errors import GatewayError
from gateway.state import GatewayState

ANONYMOUS = "anonymous"


async def provide_admin_identity(
    request: Request[Any, Any, Any], gw: NamedDependency[GatewayState]
) -> AdminIdentity:
    try:
        return gw.admin.verify(request.headers.get("authorization"))
    except GatewayError as exc:
        target = f"{request.method} {request.url.path}"
        detail = {"error": exc.message[:500]}
        await write_entry(gw, ANONYMOUS, "admin.auth", target, exc.code or "denied", detail)
        raise
