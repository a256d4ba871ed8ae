"""The gateway's request ids and the response ids made from them.

Every request gets `req_<24 hex>` (`gateway.app`'s middleware): it keys the request in the
engine, its usage event and its response-cache record. Its response is named `chatcmpl-<the
same hex>` (chat) or `cmpl-<the same hex>` (text), so the `id` of any response body, a cache
hit's too, names its request: a client's own `x-request-id` is echoed in place of the
gateway's, but never in the body.
"""

from __future__ import annotations

import secrets
from typing import Literal

REQUEST_PREFIX = "req_"
RESPONSE_PREFIXES = {"chat": "chatcmpl-", "text": "cmpl-"}


def new_request_id() -> str:
    """A request id no other request has."""
    return f"{REQUEST_PREFIX}{secrets.token_hex(12)}"


def response_id(kind: Literal["chat", "text"], request_id: str) -> str:
    """The `id` of the response to the request `request_id`."""
    return RESPONSE_PREFIXES[kind] + request_id.removeprefix(REQUEST_PREFIX)


def request_id_of(reported: str) -> str:
    """The request id that `reported` names: a response's `id`, or the request id itself (then
    returned as is, as is anything else, which names no request)."""
    for prefix in RESPONSE_PREFIXES.values():
        if reported.startswith(prefix):
            return REQUEST_PREFIX + reported.removeprefix(prefix)
    return reported
