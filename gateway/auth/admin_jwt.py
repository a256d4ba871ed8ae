"""Admin JWTs via PyJWT: the algorithm is pinned, `exp`, `iat` and the audience are required.

HS256 with a shared secret by default (`LORAMUX_ADMIN_SECRET`, or one generated and kept in the
data directory). RS256 when a public key is configured; tokens are then minted elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jwt

from gateway.errors import Unauthorized

AUDIENCE = "loramux-admin"


@dataclass(frozen=True)
class AdminIdentity:
    subject: str
    claims: dict[str, Any]


class AdminAuth:
    def __init__(self, secret: str | None, algorithm: str = "HS256", public_key: str | None = None):
        if algorithm not in ("HS256", "RS256"):
            raise ValueError("admin JWT algorithm must be HS256 or RS256")
        if algorithm == "HS256" and not secret:
            raise ValueError("HS256 admin tokens need a secret")
        if algorithm == "RS256" and not public_key:
            raise ValueError("RS256 admin tokens need a public key")
        self.algorithm = algorithm
        self._secret = secret
        self._verify_key = public_key if algorithm == "RS256" else secret

    def mint(self, subject: str = "admin", ttl_seconds: int = 3600) -> str:
        if self.algorithm != "HS256" or self._secret is None:
            raise ValueError("only HS256 tokens can be minted here")
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
                options={"require": ["exp", "iat", "aud", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthorized("admin token expired", code="invalid_token") from None
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"invalid admin token: {exc}", code="invalid_token") from None
        if claims.get("role") != "admin":
            raise Unauthorized("token is not an admin token", code="invalid_token")
        return AdminIdentity(str(claims["sub"]), claims)
