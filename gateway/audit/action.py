"""How an admin route is audited: it names its action in its `opt`, and may take the `entry`
dependency to say what it did; the admin router's middleware writes the entry.

    @put("/keys/{key_id:str}/quotas", opt=audited_as("quota.key.set", "{key_id}"))
    async def set_key_quotas(self, data: QuotaUpdate, entry: NamedDependency[AuditRecord], ...):
        entry.detail = given(data)

The middleware wraps the whole request, so a body that fails to decode or validate is an
audited failure of its action like any other; its outcome is the error the request was answered
with (`gateway.errors.exception_handler` leaves it in the request's state). The entry is written before the response starts,
so a client that reads the log next finds it. A request the admin guard refused has no actor
and writes no entry here (the guard writes its own, `admin.auth`).
"""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.types import ASGIApp, Message, Middleware, Receive, Scope, Send

from loramux.gateway.audit.service import AuditLog, AuditRecord
from loramux.gateway.auth.admin_jwt import AdminIdentity
from loramux.gateway.errors import ANSWERED_WITH

_ACTION = "audit_action"
_TARGET = "audit_target"
_RECORD = "audit_record"
IDENTITY = "admin_identity"
"""Where the admin guard leaves the verified identity in the request's state."""


def audited_as(action: str, target: str | None = None) -> dict[str, Any]:
    """The `opt` of a route audited as `action`; `target` is a template over the route's path
    parameters (`"{owner}/{name}"`), or None when the handler sets `entry.target` itself."""
    return {_ACTION: action, _TARGET: target}


def audit_middleware(audit_log: AuditLog) -> Middleware:
    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            opt = scope["route_handler"].opt
            if _ACTION not in opt:
                await app(scope, receive, send)
                return
            template = opt[_TARGET]
            target = template.format_map(scope["path_params"]) if template is not None else None
            record = AuditRecord(target)
            state = scope.setdefault("state", {})
            state[_RECORD] = record
            written = False

            async def finish(exc: Exception | None) -> None:
                nonlocal written
                identity = state.get(IDENTITY)
                if not written and isinstance(identity, AdminIdentity):
                    written = True
                    await audit_log.finish(identity.subject, opt[_ACTION], record, exc)

            async def send_after_audit(message: Message) -> None:
                if message["type"] == "http.response.start":
                    await finish(state.get(ANSWERED_WITH))
                await send(message)

            try:
                await app(scope, receive, send_after_audit)
            except Exception as exc:
                await finish(exc)
                raise

        return middleware

    return wrap


def provide_entry(request: Request[Any, Any, Any]) -> AuditRecord:
    """The audit record of this request's action."""
    record = request.state[_RECORD]
    assert isinstance(record, AuditRecord), f"{request.url.path} names no audited action"
    return record
