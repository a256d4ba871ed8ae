"""The one mapping of errors to HTTP answers (`gateway.errors`): what it makes of errors raised
outside the gateway's own hierarchy."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from loramux.gateway.errors import ServiceUnavailable, to_gateway_error


@pytest.mark.parametrize(
    "exc",
    [
        RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
        RedisTimeoutError("Timeout reading from 127.0.0.1:6379"),
        ConnectionRefusedError(111, "Connection refused"),
    ],
)
def test_a_backing_service_that_cannot_be_reached_is_a_503(exc: Exception) -> None:
    """A Redis (or any backing service) down or silent is no bug of the gateway: 503, which
    every route documents, not an unexpected 500."""
    err = to_gateway_error(exc)
    assert isinstance(err, ServiceUnavailable) and err.status == 503
    assert err.code == "backend_unavailable"
