"""One error hierarchy for the gateway, mapped to OpenAI-shaped HTTP responses in one place.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with the status an OpenAI client maps to its exception classes.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar
from urllib.parse import unquote_to_bytes

import msgspec
from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, InternalServerException, ValidationException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import SQLAlchemyError

from loramux.adapters.errors import AdapterError, FileTooLarge
from loramux.engine.errors import (
    AdapterUnavailableError,
    EngineError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    PromptTooLongError,
    RequestFailedError,
    StructuredOutputFailedError,
    UnknownAdapterError,
)
from loramux.engine.structured import StructuredOutputError
from loramux.gateway.db.faults import Fault, fault_of
from loramux.gateway.engine_client.base import EngineTimeoutError
from loramux.gateway.logged_text import loggable, writable

log = logging.getLogger(__name__)


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """The body of every error response (what `GatewayError.body` writes), as the OpenAPI
    document names it."""

    error: ErrorDetail


class GatewayError(Exception):
    status: ClassVar[int] = 400
    type: ClassVar[str] = "invalid_request_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The response body, writable whatever the message and param hold."""
        return {
            "error": {
                "message": writable(self.message),
                "type": self.type,
                "param": None if self.param is None else writable(self.param),
                "code": self.code,
            }
        }


class BadRequest(GatewayError):
    status = 400


class Unauthorized(GatewayError):
    status = 401
    default_code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    default_code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    default_code = "method_not_allowed"


class Conflict(GatewayError):
    status = 409


class PayloadTooLarge(GatewayError):
    status = 413


class UnsupportedMediaType(GatewayError):
    status = 415
    default_code = "unsupported_media_type"


class Unprocessable(GatewayError):
    status = 422


class RateLimited(GatewayError):
    """429 `rate_limit_exceeded`; `type` is `requests` or `tokens` as OpenAI writes it, and
    `refusal` the limit that refused (`requests`, `tokens` or `concurrency`), for usage."""

    status = 429
    default_code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        limit_type: str,
        refusal: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message, headers=headers)
        self.limit_type = limit_type
        self.refusal = refusal or limit_type

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["type"] = self.limit_type
        return body


class InsufficientQuota(GatewayError):
    status = 429
    type = "insufficient_quota"
    default_code = "insufficient_quota"
    refusal = "budget"


class ClientClosedRequest(GatewayError):
    """The client closed the connection before the response (nginx's 499; nobody reads it)."""

    status = 499
    default_code = "client_closed_request"


class InternalError(GatewayError):
    status = 500
    type = "server_error"
    default_code = "internal_error"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "server_error"
    default_code = "engine_unavailable"


class GatewayTimeout(GatewayError):
    """An engine did not answer in time (504, as a gateway whose upstream timed out)."""

    status = 504
    type = "server_error"
    default_code = "engine_timeout"


def to_gateway_error(exc: Exception) -> GatewayError | None:
    """The gateway error for an engine, adapter or framework error; None if it is unexpected."""
    match exc:
        case GatewayError():
            return exc
        case EngineError():
            return _from_engine(exc)
        case SQLAlchemyError() if (fault := fault_of(exc)) is not None:
            return _from_database(fault, exc)
        case ConnectionError() | RedisConnectionError() | RedisTimeoutError():
            # A driver that surfaces a refused or reset connection as the OS error itself
            # (asyncpg while connecting), or a Redis down or silent that a route did not expect
            # (redis-py's own classes): a backing service is down, not a bug. Redis's other
            # errors (a script's, a wrong type) stay unexpected.
            return ServiceUnavailable(
                "a service the gateway depends on is unavailable; retry later",
                code="backend_unavailable",
            )
        case FileTooLarge():
            return PayloadTooLarge(exc.message, code=exc.code)
        case AdapterError():
            return BadRequest(exc.message, code=exc.code)
        case msgspec.ValidationError():
            field = _FIELD_PATH.search(str(exc)) or _UNKNOWN_FIELD.search(str(exc))
            return BadRequest(
                f"invalid request body: {exc}",
                param=field[1] if field else None,
                code="invalid_request",
            )
        case msgspec.DecodeError():
            return BadRequest(f"the body is not valid JSON: {exc}", code="invalid_request")
        case UnicodeDecodeError():
            return BadRequest(f"the body is not valid UTF-8: {exc}", code="invalid_request")
        case ValidationException():
            return _invalid(exc)
        case InternalServerException() if exc.detail == _LEFT_MID_BODY:
            return ClientClosedRequest("the client closed the connection before the whole body")
        case HTTPException():
            return _for_status(exc.status_code)(
                exc.detail, code=_FRAMEWORK_CODES.get(exc.status_code)
            )
    return None


def _from_engine(exc: EngineError) -> GatewayError | None:
    match exc:
        case PromptTooLongError():
            return BadRequest(str(exc), param="messages", code="context_length_exceeded")
        case UnknownAdapterError():
            return NotFound(str(exc), param="model")
        case StructuredOutputError():
            return BadRequest(str(exc), param="response_format", code="invalid_request")
        case InvalidRequestError():
            return BadRequest(str(exc))
        case EngineOverloadedError():
            return ServiceUnavailable(str(exc), code="engine_overloaded")
        case EngineStoppedError():
            return ServiceUnavailable(str(exc))
        case EngineTimeoutError():
            return GatewayTimeout(str(exc))
        case AdapterUnavailableError():
            # The adapter's stored files, not the request nor the caller's upload (validated
            # when it was stored): the server's to fix; a retry loads it again.
            return ServiceUnavailable(str(exc), code="adapter_unavailable")
        case StructuredOutputFailedError():  # the request's own schema: the client's error
            return BadRequest(str(exc), code="structured_output_failed")
        case RequestFailedError():
            return InternalError(str(exc), code="request_failed")
    return None


def _from_database(fault: Fault, exc: Exception) -> GatewayError:
    """The answer to a database error (`gateway.db.faults`)."""
    if fault == "unavailable":
        return ServiceUnavailable(
            "the database is unavailable; retry later", code="database_unavailable"
        )
    if fault == "unstorable_text":
        # What `refuse_nul` does not see (a body's field): the client's text, not a fault.
        return BadRequest(_NUL_MESSAGE.format(where="the request"), code="invalid_request")
    # A writer that did not lock what it writes: logged, as the bug it is; the client retries.
    log.warning("a write met a row deleted meanwhile: %s", exc)
    return Conflict(
        "what this request writes was deleted by another request meanwhile; read it and retry",
        code="concurrent_delete",
    )


_FIELD_PATH = re.compile(r" - at `\$\.([A-Za-z_]\w*)")
_UNKNOWN_FIELD = re.compile(r"unknown field `([A-Za-z_]\w*)`")
"""The top-level field a msgspec validation error names (`... - at `$.rpm``), or the unknown
field it refuses."""
_LEFT_MID_BODY = "client disconnected prematurely"
"""What Litestar raises (as a 500) when the client disconnects while the body is read
(`litestar.connection.Request.stream`): the client left, nothing failed here."""

_FRAMEWORK_CODES = {400: "invalid_request", 404: "not_found"}
"""The codes of the errors Litestar raises itself: a body it cannot parse (400), no route (404)."""


def _for_status(status: int) -> type[GatewayError]:
    """The class of an error Litestar raised with `status`; the nearest one for a status of no
    class here (a 4xx is the client's, anything else the server's)."""
    for cls in _BY_STATUS:
        if cls.status == status:
            return cls
    return BadRequest if 400 <= status < 500 else InternalError


def _invalid(exc: ValidationException) -> BadRequest:
    """A request Litestar refused while validating it (body, query or path): the message names
    each offending field, and `param` the first one (None for the body as a whole)."""
    extra = exc.extra if isinstance(exc.extra, list) else []
    errors = [e for e in extra if isinstance(e, dict)]
    parts = [f"{e.get('key') or 'body'}: {e.get('message')}" for e in errors]
    message = "invalid request" + (": " + "; ".join(parts) if parts else f": {exc.detail}")
    key = errors[0].get("key") if errors else None
    param = key if isinstance(key, str) and key != "data" else None
    return BadRequest(message, param=param, code="invalid_request")


_BY_STATUS: tuple[type[GatewayError], ...] = (
    BadRequest,
    Unauthorized,
    PermissionDenied,
    NotFound,
    MethodNotAllowed,
    Conflict,
    PayloadTooLarge,
    UnsupportedMediaType,
    Unprocessable,
    InternalError,
    ServiceUnavailable,
)


def as_gateway_error(exc: Exception) -> GatewayError:
    """The gateway error for `exc`; an unexpected one is logged and becomes a 500."""
    err = to_gateway_error(exc)
    if err is None:
        log.error("unexpected error", exc_info=exc)
        err = InternalError("internal error")
    return err


async def refuse_empty_segments(connection: ASGIConnection[Any, Any, Any, Any], _: object) -> None:
    """The app's guard: no route has an empty segment. The router skips empty segments, so
    `/admin/tenants//quotas` would reach `/admin/tenants/{tenant}` with the tenant `quotas`;
    this refuses it before any handler runs. Paths that match no route at all get the same 404
    from `exception_handler`. Async, as every guard must be: Litestar runs a sync guard on a
    worker thread, a thread hop on every request."""
    if path := _with_empty_segment(connection.scope):
        raise _empty_segment(path)


def _with_empty_segment(scope: Any) -> str:
    """The path, percent-decoded, when it has an empty segment, else ''. The router rewrites
    `scope["path"]` without them, so this reads `raw_path`, decoded as the server decodes it
    for the router: `/admin/tenants/%2Fvictim` is routed as `/admin/tenants//victim`, and
    reached (and deleted) the tenant `victim` when only a literal `//` was refused."""
    raw = scope.get("raw_path") or scope["path"].encode()
    decoded = unquote_to_bytes(raw) if b"%" in raw else raw
    return decoded.decode("latin-1") if b"//" in decoded else ""


def _empty_segment(path: str) -> NotFound:
    """`/admin/tenants//keys` lacks the tenant: a 404 that says so."""
    position = path.index("//")
    return NotFound(
        f"the path {path[:200]!r} has an empty segment at character {position + 1}: "
        "a name or id is missing between two slashes",
        code="empty_path_segment",
    )


NUL = "\x00"
_NUL_MESSAGE = "{where} holds a NUL character (U+0000), which no name, id or filter may hold"


async def refuse_nul(connection: ASGIConnection[Any, Any, Any, Any], _: object) -> None:
    """A router's guard, after its authentication: no reference or filter holds NUL, answered
    here alike on every database. PostgreSQL cannot compare text holding it (22021) and
    SQLite's LIKE ends a pattern there (a `?name=` filter of NUL matched every row). A path
    holding it names nothing (404); a query parameter holding it is a bad filter (400)."""
    if NUL in connection.scope["path"]:
        raise NotFound(_NUL_MESSAGE.format(where="the path"), code="not_found")
    for key, value in connection.query_params.multi_items():
        if NUL in key or NUL in value:
            where = f"the query parameter {key[:100]!r}"
            raise BadRequest(_NUL_MESSAGE.format(where=where), param=key, code="invalid_request")


ANSWERED_WITH = "answered_with"
"""Where the handler leaves the error a request was answered with, in the request's state (the
admin audit reads it)."""


def exception_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    err = to_gateway_error(exc)
    if err is None:
        log.exception("unhandled error on %s %s", request.method, loggable(request.url.path))
        err = InternalError("internal error")
    if err.status in (404, 405) and (path := _with_empty_segment(request.scope)):
        err = _empty_segment(path)
    request.state[ANSWERED_WITH] = err
    return Response(
        err.body(), status_code=err.status, headers=err.headers, media_type="application/json"
    )
