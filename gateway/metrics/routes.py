"""The one route label every gateway metric uses: a request's path template, bounded."""

from __future__ import annotations

from typing import Literal

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ARRIVED = "arrived"
"""Where the request's arrival (time.perf_counter(), when the gateway's first middleware saw
it) is kept in its scope's state: every time a request is billed or measured with counts from
there, as its client's clock does."""
ROUTES = (CHAT, COMPLETIONS, "/v1/models", "/health", "/ready", "/metrics", "/dashboard")
ROUTE_LABELS = (*ROUTES, "/admin", "other")
"""Every value `route_label` returns."""


def route_label(path: str) -> str:
    """A bounded metric label for a request path: the route itself, `/admin` for every admin
    route (their paths carry ids and names), `/dashboard` for its pages, else `other`."""
    if path in ROUTES:
        return path
    for prefix in ("/admin", "/dashboard"):
        if path.startswith(prefix + "/"):
            return prefix
    return "other"


def completion_route(kind: Literal["chat", "text"]) -> str:
    """The route label of a completion request of `kind` (the same the middleware writes)."""
    return CHAT if kind == "chat" else COMPLETIONS
