"""The Litestar application: routes, dependencies, the one error handler, request ids."""

from __future__ import annotations

import re
import time

from litestar import Litestar
from litestar.datastructures import MutableScopeHeaders
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry.trace import StatusCode

from loramux.gateway import tracing
from loramux.gateway.admin.router import admin_router
from loramux.gateway.api_docs import explorer, explorer_asset
from loramux.gateway.dashboard import dashboard_router
from loramux.gateway.dashboard.routes import security_headers
from loramux.gateway.errors import exception_handler, refuse_empty_segments
from loramux.gateway.health import health_router
from loramux.gateway.metrics import Metrics, route_label
from loramux.gateway.metrics.routes import ARRIVED, CHAT, COMPLETIONS
from loramux.gateway.openai import openai_router
from loramux.gateway.request_ids import new_request_id
from loramux.gateway.state import GatewayState

CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,64}")
"""An `x-request-id` a client may have echoed back: a plain token of at most 64 characters."""


def request_id_middleware(app: ASGIApp, metrics: Metrics) -> ASGIApp:
    """Give every request an id of its own, echo an id on the response, and count the request
    by route and status code, and time it to its end. A completion request is traced
    (gateway.tracing) when tracing is on.

    The gateway's id (`req_<random>`, in `scope["state"]["request_id"]`) keys the request in
    the engine and names its response (`chatcmpl-…`: gateway.request_ids) and usage event. A
    client's `x-request-id` is only echoed back for its tracing (when it is a plain token, else
    the gateway's id is): ids clients choose collide across tenants, so they never key anything.
    The response's `id` always names the gateway's (a wrong cache hit is reported by it)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = new_request_id()
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        echoed = incoming if CLIENT_REQUEST_ID.fullmatch(incoming) else request_id
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state[ARRIVED] = started

        route = route_label(scope["path"])

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableScopeHeaders.from_message(message)["x-request-id"] = echoed
                metrics.http.requests.labels(route, str(message["status"])).inc()
            await send(message)

        try:
            if route in (CHAT, COMPLETIONS) and tracing.enabled():
                await _traced(app, scope, receive, send_with_id, route)
            else:
                await app(scope, receive, send_with_id)
        finally:
            metrics.http.duration.labels(route).observe(time.perf_counter() - started)

    return middleware


async def _traced(app: ASGIApp, scope: Scope, receive: Receive, send: Send, route: str) -> None:
    """Run the request under its SERVER span, which records the response's status."""
    operation = tracing.OPERATIONS["chat" if route == CHAT else "text"]
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    request_id = scope["state"]["request_id"]
    with tracing.request_span(operation, route, request_id, headers) as span:

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:
                    span.set_status(StatusCode.ERROR)
            await send(message)

        await app(scope, receive, send_status)


def create_app(gw: GatewayState) -> Litestar:
    async def provide_state() -> GatewayState:
        return gw

    return Litestar(
        route_handlers=[
            health_router(gw),
            openai_router(gw),
            admin_router(gw),
            explorer_asset,
            dashboard_router(gw),
        ],
        dependencies={
            "gw": Provide(provide_state),
        },
        exception_handlers={Exception: exception_handler},
        guards=[refuse_empty_segments],
        middleware=[lambda app: request_id_middleware(app, gw.metrics)],
        before_send=[security_headers],
        openapi_config=OpenAPIConfig(
            title="loramux",
            version="0.1.0",
            path="/schema",
            # The explorer for operators, at /schema/ (and /schema/swagger), with its assets
            # served here (gateway.api_docs).
            render_plugins=[explorer()],
        ),
        request_max_body_size=gw.settings.server.max_body_kb << 10,
        on_startup=[gw.start],
        on_shutdown=[gw.close],
        debug=False,
    )
