"""Admin JWTs via PyJWT: the algorithm is pinned, `exp`, `iat` and the audience are required.

HS256 with a shared secret by default (`LORAMUX_ADMIN_SECRET`, or one generated and kept in the
data directory). RS256 when a public key is configured; tokens are then minted elsewhere.

A token lives at most `max_ttl` seconds (LORAMUX_ADMIN_TOKEN_MAX_TTL): `exp - iat` and
`exp - now` are both bounded, and `iat` and `exp` must be integers, so a leaked token cannot
have been minted to last for ever (`exp: 1e20`). Clocks may differ by `CLOCK_SKEW_SECONDS`:
a token minted on a host whose clock runs that far ahead (its `iat` in our future, `exp` up to
`max_ttl` past it) is taken, and one is refused that much after its `exp`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, TypeGuard

import jwt

from loramux.gateway.errors import Unauthorized

AUDIENCE = "loramux-admin"
DEFAULT_MAX_TTL = 24 * 3600
CLOCK_SKEW_SECONDS = 30
"""How far the minting host's clock may be from ours, either way."""


@dataclass(frozen=True)
class AdminIdentity:
    subject: str
    claims: dict[str, Any]


class AdminAuth:
    def __init__(
        self,
        secret: str | None,
        algorithm: str = "HS256",
        public_key: str | None = None,
        max_ttl: int = DEFAULT_MAX_TTL,
    ):
        if algorithm not in ("HS256", "RS256"):
            raise ValueError("admin JWT algorithm must be HS256 or RS256")
        if algorithm == "HS256" and not secret:
            raise ValueError("HS256 admin tokens need a secret")
        if algorithm == "RS256" and not public_key:
            raise ValueError("RS256 admin tokens need a public key")
        if max_ttl < 1:
            raise ValueError("LORAMUX_ADMIN_TOKEN_MAX_TTL must be at least 1 second")
        self.algorithm = algorithm
        self.max_ttl = max_ttl
        self._secret = secret
        self._verify_key = public_key if algorithm == "RS256" else secret

    def mint(self, subject: str = "admin", ttl_seconds: int = 3600) -> str:
        """A token for `subject` valid for `ttl_seconds` (at most `max_ttl`; a negative ttl
        mints an expired token)."""
        if self.algorithm != "HS256" or self._secret is None:
            raise ValueError("only HS256 tokens can be minted here")
        if ttl_seconds > self.max_ttl:
            raise ValueError(
                f"an admin token may live {self.max_ttl} s at most "
                f"(LORAMUX_ADMIN_TOKEN_MAX_TTL), not {ttl_seconds} s"
            )
        now = int(time.time())
        claims = {
            "sub": subject,
            "iat": now,
            "exp": now + ttl_seconds,
            "aud": AUDIENCE,
            "role": "admin",
        }
        return jwt.encode(claims, self._secret, algorithm="HS256")

    def verify(self, authorization: str | None) -> AdminIdentity:
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized(
                "admin token required: send 'Authorization: Bearer <admin JWT>'",
                code="invalid_token",
            )
        token = authorization[7:].strip()
        try:
            claims = jwt.decode(
                token,
                self._verify_key,  # type: ignore[arg-type]
                algorithms=[self.algorithm],
                audience=AUDIENCE,
                leeway=CLOCK_SKEW_SECONDS,
                options={"require": ["exp", "iat", "aud", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthorized("admin token expired", code="invalid_token") from None
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"invalid admin token: {exc}", code="invalid_token") from None
        if claims.get("role") != "admin":
            raise Unauthorized("token is not an admin token", code="invalid_token")
        self._check_lifetime(claims["iat"], claims["exp"])
        return AdminIdentity(str(claims["sub"]), claims)

    def _check_lifetime(self, iat: object, exp: object) -> None:
        """Refuse a token meant to live longer than `max_ttl`, or with non-integer times (PyJWT
        takes `1e20` or `"123"` as numbers). `exp - now` may exceed it by the clock skew."""
        if not (_is_int(iat) and _is_int(exp)):
            raise Unauthorized(
                "invalid admin token: iat and exp must be integers", code="invalid_token"
            )
        left = exp - int(time.time()) - CLOCK_SKEW_SECONDS
        if exp - iat > self.max_ttl or left > self.max_ttl:
            raise Unauthorized(
                f"admin token lives longer than the {self.max_ttl} s allowed "
                "(LORAMUX_ADMIN_TOKEN_MAX_TTL)",
                code="invalid_token",
            )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
