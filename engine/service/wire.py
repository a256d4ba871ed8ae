"""The engine service's wire format, shared by the service and the gateway's remote client.

Bodies are JSON, encoded and validated with msgspec straight from the engine's dataclasses:

    POST /generate, /count_tokens   an EngineRequest:
        {"request_id": str, "prompt": str | null, "prompt_token_ids": [int] | null,
         "messages": [{...}] | null, "adapter": digest | null, "cache_salt": str | null,
         "params": {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop": [str],
                    "stop_token_ids": [int], "ignore_eos", "extra": {}}}
    /generate answers NDJSON, one RequestOutput per line:
        {"request_id", "text", "token_ids": [int], "finish_reason": null | "stop" | "length" |
         "abort", "usage": null | {"prompt_tokens", "completion_tokens", "cached_tokens"},
         "error": null}
    An error, as a whole body (before the stream starts) or as the stream's last line (e.g.
    `request_failed` when the engine could not compute this one request):
        {"error": {"kind": "engine" | "adapter" | "http", "code": str, "message": str}}

Every typed error has one stable `code` and one status, so the client re-raises the same class.
"""

from __future__ import annotations

from typing import Any

import msgspec

from adapters.errors import AdapterError, FileTooLarge
from engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    PromptTooLongError,
    RequestFailedError,
    UnknownAdapterError,
)
from engine.outputs import EngineRequest, RequestOutput

TOKEN_HEADER = "x-loramux-engine-token"
"""Carries the shared secret (LORAMUX_ENGINE_TOKEN) when the service is started with one."""


class UnauthorizedError(EngineError):
    """The request lacks the service's shared secret (or carries a wrong one)."""


# Subclasses before their bases: the first isinstance match names an error.
ENGINE_ERRORS: tuple[tuple[type[EngineError], str, int], ...] = (
    (PromptTooLongError, "prompt_too_long", 400),
    (UnknownAdapterError, "unknown_adapter", 404),
    (InvalidRequestError, "invalid_request", 400),
    (EngineOverloadedError, "engine_overloaded", 503),
    (EngineStoppedError, "engine_stopped", 503),
    (RequestFailedError, "request_failed", 500),
    (UnauthorizedError, "unauthorized", 401),
)

_encoder = msgspec.json.Encoder()


def encode(value: object) -> bytes:
    """JSON of a request, output, stats or any plain value (dataclasses by their fields)."""
    return _encoder.encode(value)


def decode_request(body: bytes) -> EngineRequest:
    """The EngineRequest in `body`; InvalidRequestError when it is not one (nothing queued)."""
    try:
        return msgspec.json.decode(body, type=EngineRequest)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"malformed request body: {exc}") from None


def decode_line(line: str | bytes) -> RequestOutput:
    """One NDJSON line of a /generate stream; an error line raises its typed error."""
    obj = msgspec.json.decode(line)
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        raise error_from(obj)
    return msgspec.convert(obj, RequestOutput)


def error_payload(exc: Exception) -> tuple[int, dict[str, Any]] | None:
    """Status and body of a typed engine or adapter error; None for anything unexpected."""
    if isinstance(exc, AdapterError):
        status = 413 if isinstance(exc, FileTooLarge) else 400
        return status, _body("adapter", exc.code, exc.message)
    for cls, code, status in ENGINE_ERRORS:
        if isinstance(exc, cls):
            return status, _body("engine", code, str(exc))
    return None


def internal_error_payload(message: str) -> dict[str, Any]:
    return _body("engine", "internal_error", message)


def error_from(payload: object, status: int = 500) -> Exception:
    """The exception an error body stands for: the same typed class the service raised."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return EngineError(f"the engine answered {status} without an error body")
    kind, code, message = error.get("kind"), error.get("code"), str(error.get("message", ""))
    if kind == "adapter":
        return _adapter_error_classes().get(str(code), AdapterError)(message)
    for cls, known, _ in ENGINE_ERRORS:
        if code == known:
            return cls(message)
    return EngineError(f"engine error {code} ({status}): {message}")


def _body(kind: str, code: str, message: str) -> dict[str, Any]:
    return {"error": {"kind": kind, "code": code, "message": message}}


def _adapter_error_classes() -> dict[str, type[AdapterError]]:
    found: dict[str, type[AdapterError]] = {}
    pending: list[type[AdapterError]] = [AdapterError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found
