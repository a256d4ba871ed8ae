"""CURVE (CurveZMQ) on the channel's tcp:// connections when there is an engine token: every
frame encrypted and authenticated, and a peer without the token refused at the handshake,
before ZeroMQ takes a byte of its messages (without it, ZeroMQ buffered an unauthenticated
peer's whole message, up to the engine's 512 MiB limit, before the engine read its head).
The handshake's own frames are read before any key is shown: what a stranger can make the
engine buffer is bounded by the socket's frame limit and its handshake deadline
(engine.service.server), not by CURVE.

Nothing new is distributed: both key pairs derive from the engine token (HMAC-SHA256 of the
token, a label for each end), so whoever holds the token, and only they, can derive them, as
only they may call the engine anyway. The engine accepts only the gateways' public key (a ZAP
handler on its event loop, consulted once per connection); a gateway completes the handshake
only with a peer holding the engine's secret key. The token still travels in every message,
now encrypted. ipc:// stays as it was: a unix socket in the private data directory.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

_LABELS = (b"loramux engine channel: engine", b"loramux engine channel: gateway")
LOG_EVERY_SECONDS = 10.0


@dataclass(frozen=True)
class CurveKeys:
    """The two ends' key pairs, z85-encoded as ZeroMQ takes them."""

    engine_public: bytes
    engine_secret: bytes
    gateway_public: bytes
    gateway_secret: bytes

    @classmethod
    def of(cls, token: str) -> CurveKeys:
        engine_secret, gateway_secret = (_secret(token, label) for label in _LABELS)
        return cls(
            zmq.curve_public(engine_secret),
            engine_secret,
            zmq.curve_public(gateway_secret),
            gateway_secret,
        )


def uses_curve(address: str, token: str | None) -> bool:
    """Whether the channel at `address` runs CURVE: tcp:// with a token."""
    return bool(token) and address.startswith("tcp://")


def refuse_open_listener(address: str, token: str | None) -> None:
    """An engine listening beyond this host needs a token (ValueError otherwise): anyone who
    could reach the port could run requests on any adapter and read every reply."""
    if token or not address.startswith("tcp://"):
        return
    host = (urlsplit(address).hostname or "").strip("[]")
    if host == "localhost" or _is_loopback(host):
        return
    raise ValueError(
        f"the engine would listen on {address} without a token: set LORAMUX_ENGINE_TOKEN "
        "(on the engine and its gateways), or listen on 127.0.0.1 or ipc://"
    )


def secure_engine(socket: zmq.asyncio.Socket, keys: CurveKeys) -> AsyncioAuthenticator:
    """Make `socket` (not yet bound) a CURVE server that accepts only the gateways' key; the
    returned handler must be stopped with the socket. Call on the engine's event loop."""
    _require_curve()
    authenticator = AsyncioAuthenticator(socket.context)
    authenticator.start()
    authenticator.configure_curve_callback("*", _GatewayKey(keys.gateway_public))
    socket.curve_server = True
    socket.curve_secretkey = keys.engine_secret
    return authenticator


def secure_gateway(socket: zmq.asyncio.Socket, keys: CurveKeys) -> None:
    """Make `socket` (not yet connected) a CURVE client of the engine."""
    _require_curve()
    socket.curve_serverkey = keys.engine_public
    socket.curve_publickey = keys.gateway_public
    socket.curve_secretkey = keys.gateway_secret


class _GatewayKey:
    """The ZAP decision: the peer's public key is the gateways' (compared in constant time).
    Refusals are logged at most once per LOG_EVERY_SECONDS."""

    def __init__(self, gateway_public: bytes):
        self.gateway_public = gateway_public
        self._logged = -LOG_EVERY_SECONDS

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.gateway_public):
            return True
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_SECONDS:
            self._logged = now
            log.warning("refused a connection whose key is not the engine token's")
        return False


def _secret(token: str, label: bytes) -> bytes:
    return z85.encode(hmac.new(token.encode(), label, hashlib.sha256).digest())


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name or an interface (tcp://eth0:8100, tcp://*:8100)
        return False


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError(
            "this libzmq has no CURVE support, which a tcp:// channel with a token needs"
        )
