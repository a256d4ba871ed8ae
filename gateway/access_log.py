"""Keep credentials out of the access log: uvicorn writes each request's query string verbatim,
and a client that sends its API key as `?api_key=lmx-…` would leave it in every log line.

`redact_access_log()` filters uvicorn's access logger so that a logged request target keeps its
path and its parameter names but never a value: `/v1/models?api_key=[redacted]`. A part that
is not a plain `name=value` pair (a bare value, or a name that could itself be a secret) is
redacted whole.
"""

from __future__ import annotations

import logging
import re

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "[redacted]"
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
_TARGET_ARG = 2
"""uvicorn's access record: args (client, method, target, http version, status)."""


def redact_query(target: str) -> str:
    """`target` (a path with an optional query string) with every query value redacted."""
    path, has_query, query = target.partition("?")
    if not has_query:
        return target
    parts = []
    for part in query.split("&"):
        name, has_value, _ = part.partition("=")
        plain = has_value and _PLAIN_NAME.fullmatch(name)
        parts.append(f"{name}={REDACTED}" if plain else REDACTED)
    return f"{path}?{'&'.join(parts)}"


class QueryRedaction(logging.Filter):
    """Rewrites the request target of uvicorn's access records (leaves other records alone)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:
            target = args[_TARGET_ARG]
            if isinstance(target, str):
                record.args = (*args[:_TARGET_ARG], redact_query(target), *args[3:])
        return True


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (once per process). A logger's filters
    survive uvicorn's own logging configuration, which replaces only handlers."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, QueryRedaction) for f in logger.filters):
        logger.addFilter(QueryRedaction())
