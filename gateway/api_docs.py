"""What the OpenAPI document (`/schema`) says beyond the handlers' own types: the error
responses each route can give, all in the one `ErrorResponse` shape; and the API explorer.

Litestar documents a refused parameter as its own `ValidationException` body; the gateway
answers every error in OpenAI's shape (`gateway.errors`), so each route lists its error statuses
here and they replace Litestar's.

The explorer (Swagger UI at `/schema/swagger`) loads its script, style and icon from the
gateway itself (`/schema-assets/…`, the files the `swagger-ui-py` package ships), never from a
public CDN, so it works on an offline or air-gapped host.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import swagger_ui
from litestar import get
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.openapi.spec import Operation, RequestBody
from litestar.params import FromPath
from litestar.response import File

from loramux.gateway.errors import ErrorResponse, NotFound

EXPLORER_ASSETS = "/schema-assets"
_ASSET_DIR = Path(swagger_ui.__file__).parent / "static"
_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui-standalone-preset.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
"""The explorer's files, by name: all it loads, and all `explorer_asset` serves."""


def explorer() -> SwaggerRenderPlugin:
    """Swagger UI at `/schema/swagger` (and `/schema/`), its assets served by `explorer_asset`."""
    return SwaggerRenderPlugin(
        js_url=f"{EXPLORER_ASSETS}/swagger-ui-bundle.js",
        css_url=f"{EXPLORER_ASSETS}/swagger-ui.css",
        standalone_preset_js_url=f"{EXPLORER_ASSETS}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' type='image/png' href='{EXPLORER_ASSETS}/favicon-32x32.png'>",
    )


@get(f"{EXPLORER_ASSETS}/{{name:str}}", include_in_schema=False, sync_to_thread=False)
def explorer_asset(name: FromPath[str]) -> File:
    """One of the explorer's files; they change only with the package, so they may be cached."""
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no explorer asset {name[:100]!r}", code="not_found")
    return File(
        _ASSET_DIR / name,
        media_type=media_type,
        content_disposition_type="inline",
        headers={"cache-control": "public, max-age=86400"},
    )


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
    504: "The engine gave no first output in time (LORAMUX_ENGINE_FIRST_OUTPUT_SECONDS); the "
    "request was aborted there.",
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
