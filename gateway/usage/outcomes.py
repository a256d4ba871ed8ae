"""Usage events for completion requests answered with an error before they reached the engine.

A request that reaches the engine is metered when it ends (`gateway.openai.service`), with its
status: 200, 499 when the client left first, or the engine's error. One refused earlier (a 429
from a quota, a 400 for its body, a 404 for its model, a 503 when Redis or the database cannot
serve) would otherwise leave no trace in usage, and the dashboard could not show refusals and
client errors. This route middleware records those: the caller is known (the API-key guard ran),
the request was answered from an exception (`ANSWERED_WITH`), and nothing metered it (the
handler marks a request `METERED` once the service owns its metering).
"""

from __future__ import annotations

import time
from typing import Any

from litestar.types import ASGIApp, Middleware, Receive, Scope, Send

from loramux.gateway.auth.api_keys import Principal
from loramux.gateway.catalog import ResolvedModel
from loramux.gateway.errors import ANSWERED_WITH, GatewayError
from loramux.gateway.metrics.routes import ARRIVED
from loramux.gateway.usage.recorder import UsageRecord, UsageRecorder

METERED = "usage_metered"
"""Set in the request's state once the completion service will meter the request itself."""
UNRESOLVED_MODEL = ""
"""The model of a request refused before its model was resolved (or could be read)."""


def record_unmetered(recorder: UsageRecorder, principal_key: str, model_key: str) -> Middleware:
    """The middleware, reading the caller from the request's state at `principal_key`, and the
    model the request resolved to, if it got that far, at `model_key` (a ResolvedModel): a
    request refused after its model was resolved (a 429, say) is recorded under that model,
    beside the requests it served."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            started = scope.get("state", {}).get(ARRIVED, time.perf_counter())
            try:
                await app(scope, receive, send)
            finally:
                state: dict[str, Any] = scope.get("state", {})
                error = state.get(ANSWERED_WITH)
                principal = state.get(principal_key)
                completion = scope.get("method") == "POST"
                if (
                    completion
                    and principal is not None
                    and error is not None
                    and not state.get(METERED)
                ):
                    model = state.get(model_key)
                    recorder.record(_refused(state, principal, model, error, started))

        return middleware

    return wrap


def _refused(
    state: dict[str, Any],
    principal: Principal,
    model: ResolvedModel | None,
    error: GatewayError,
    started: float,
) -> UsageRecord:
    return UsageRecord(
        request_id=state.get("request_id", ""),
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        model=UNRESOLVED_MODEL if model is None else model.billed_as,
        adapter_digest=None if model is None else model.digest,
        prompt_tokens=0,
        completion_tokens=0,
        cached_tokens=0,
        cache="bypass",
        status=error.status,
        latency_ms=(time.perf_counter() - started) * 1000,
        ttft_ms=None,
        refusal=getattr(error, "refusal", None),
    )
