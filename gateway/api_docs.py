"""What the OpenAPI document (`/schema`) says beyond the handlers' own types: the error
responses each route can give, all in the one `ErrorResponse` shape.

Litestar documents a refused parameter as its own `ValidationException` body; the gateway
answers every error in OpenAI's shape (`gateway.errors`), so each route lists its error statuses
here and they replace Litestar's.
"""

from __future__ import annotations

from dataclasses import dataclass

from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Operation, RequestBody

from gateway.errors import ErrorResponse

_MEANINGS = {
    400: "The request is malformed: a parameter or body field is invalid (`param` names it).",
    401: "No valid credentials: a missing, unknown, revoked or expired key or token.",
    403: "The key may not use this model.",
    404: "Nothing by that id or name.",
    409: "The name is taken, or the change conflicts with the current state.",
    413: "The body is larger than the gateway accepts.",
    415: "The body is not JSON (Content-Type) or not UTF-8.",
    422: "The body is well formed but cannot be acted on (`code` says why).",
    429: "A quota is reached (`rate_limit_exceeded`: rpm, tpm or concurrency; "
    "`insufficient_quota`: the token budget). `retry-after` says when to retry.",
    503: "A backing service (engine, database, Redis) cannot serve now; retry later.",
}


def errors(*statuses: int) -> dict[int, ResponseSpec]:
    """The `responses=` of a route handler that can answer with `statuses`."""
    return {
        status: ResponseSpec(
            data_container=ErrorResponse, description=_MEANINGS[status], generate_examples=False
        )
        for status in statuses
    }


def admin_errors(*statuses: int) -> dict[int, ResponseSpec]:
    """An admin route's errors: `statuses`, and those every admin route can give (a missing or
    invalid admin token, a database that cannot serve)."""
    return errors(401, 503, *statuses)


def documented_body(body: RequestBody) -> type[Operation]:
    """The `operation_class=` of a route handler that reads its body itself (Litestar documents
    only a body it decodes into `data`)."""

    @dataclass
    class WithBody(Operation):
        def __post_init__(self) -> None:
            self.request_body = body

    return WithBody
