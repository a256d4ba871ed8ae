"""Dashboard sign-in: an API key or an admin token is exchanged for a short-lived session JWT,
kept in a cookie the page's scripts cannot read (HttpOnly) and the browser never sends from
another site (SameSite=Strict).

The session token is HS256 with its own audience, signed with a key derived from the admin
secret (HMAC of a fixed label), so it is never accepted as an admin token nor the other way
round, and every gateway sharing the admin secret accepts it. The label separates the two
uses, but a tenant's own cookie still lets it test guesses of the admin secret offline: only the
secret's length (`setting_checks.MIN_SECRET_BYTES`, checked at start) makes that hopeless.
A tenant session lasts `SESSION_SECONDS`; an admin session no longer than the admin token it
came from, so a token past its `exp` signs in to none (though the admin API takes it within
the clock skew). A tenant session also ends as soon as its key is revoked or expires or its tenant is
disabled.

Signing out ends the session itself, not only the browser's cookie: each session token carries
an id (`jti`), and sign-out writes that id to the quota Redis until the token's expiry, where
every request looks it up; other sessions of the same key or admin token go on. The quota Redis
is what every gateway shares (and `noeviction`); if it does not answer at sign-out the cookie is
still deleted and the user is told the session lasts until its expiry, and while it does not
answer, sessions are not checked against it (the dashboard stays usable without Redis). A Redis
that restarts empty forgets sign-outs: their sessions last at most `SESSION_SECONDS` more.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import jwt
from redis.exceptions import RedisError

from loramux.gateway.admin.guard import ANONYMOUS
from loramux.gateway.dashboard.sources import DashboardSources
from loramux.gateway.db import ApiKey, Tenant
from loramux.gateway.errors import GatewayError, Unauthorized

COOKIE = "loramux_dashboard"
AUDIENCE = "loramux-dashboard"
SESSION_SECONDS = 15 * 60
_LABEL = b"loramux dashboard session v1"
LOGIN = "POST /dashboard/login"
"""The audit log's target for an admin token refused at the dashboard's sign-in."""
SIGNED_OUT = "lmx:dash:signed-out:"
"""Prefix of the quota Redis keys naming a signed-out session (by its `jti`) until it expires."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a tenant through one of its keys (`tenant_id` set) or an admin (None)."""

    subject: str
    """The key id for a tenant, the admin token's subject for an admin."""
    tenant_id: str | None
    expires_at: int
    """Unix time the session ends."""
    session_id: str
    """The session token's `jti`: what sign-out records."""

    @property
    def is_admin(self) -> bool:
        return self.tenant_id is None


@functools.lru_cache(maxsize=4)
def _signing_key(secret: str) -> bytes:
    return hmac.new(secret.encode(), _LABEL, hashlib.sha256).digest()


def signing_key(src: DashboardSources) -> bytes:
    return _signing_key(src.admin_secret)


def mint(src: DashboardSources, viewer: Viewer) -> str:
    claims = {
        "sub": viewer.subject,
        "tenant": viewer.tenant_id,
        "role": "admin" if viewer.is_admin else "tenant",
        "aud": AUDIENCE,
        "iat": int(time.time()),
        "exp": viewer.expires_at,
        "jti": viewer.session_id,
    }
    return jwt.encode(claims, signing_key(src), algorithm="HS256")


def decode(src: DashboardSources, token: str | None) -> Viewer:
    """The viewer of a session token; Unauthorized when missing, tampered with or expired."""
    if not token:
        raise Unauthorized("sign in to the dashboard first", code="invalid_session")
    try:
        claims = jwt.decode(
            token,
            signing_key(src),
            algorithms=["HS256"],
            audience=AUDIENCE,
            options={"require": ["exp", "iat", "aud", "sub", "jti"]},
        )
    except jwt.ExpiredSignatureError:
        raise Unauthorized("the dashboard session has expired", code="invalid_session") from None
    except jwt.PyJWTError:
        raise Unauthorized("invalid dashboard session", code="invalid_session") from None
    tenant = claims.get("tenant")
    if (claims.get("role") == "admin") != (tenant is None):
        raise Unauthorized("invalid dashboard session", code="invalid_session")
    return Viewer(str(claims["sub"]), tenant, int(claims["exp"]), str(claims["jti"]))


async def sign_in(src: DashboardSources, credential: str) -> Viewer:
    """The viewer for a pasted API key (`lmx-…`) or an admin token not past its `exp`;
    Unauthorized otherwise."""
    credential = credential.strip()
    now = int(time.time())
    if credential.startswith("lmx-"):
        principal = await src.keys.authenticate(f"Bearer {credential}")
        return Viewer(principal.key_id, principal.tenant_id, now + SESSION_SECONDS, _new_id())
    try:
        identity = src.admin.verify(f"Bearer {credential}")
        if int(identity.claims["exp"]) <= now:
            # Taken by the admin API within the clock skew, but a session ending at its `exp`
            # would be over before it began (a cookie of Max-Age 0, and no word of why).
            raise Unauthorized("admin token expired", code="invalid_token")
    except GatewayError as exc:
        # Audited as the admin API's guard audits a refused token: someone guessing admin
        # tokens here instead was invisible in the audit log.
        detail = {"error": exc.message[:500]}
        await src.audit.write(ANONYMOUS, "admin.auth", LOGIN, exc.code or "denied", detail)
        raise
    expires = min(now + SESSION_SECONDS, int(identity.claims["exp"]))
    return Viewer(identity.subject, None, expires, _new_id())


def _new_id() -> str:
    return secrets.token_urlsafe(16)


async def current_viewer(src: DashboardSources, token: str | None) -> Viewer:
    """The viewer of the session cookie, if it is still valid, was not signed out, and the key
    behind it is still valid."""
    viewer = decode(src, token)
    if await _signed_out(src, viewer):
        raise Unauthorized("this dashboard session was signed out", code="invalid_session")
    if viewer.is_admin:
        return viewer
    async with src.sessions() as session:
        key = await session.get(ApiKey, viewer.subject)
        tenant = await session.get(Tenant, key.tenant_id) if key is not None else None
    if key is None or tenant is None or key.tenant_id != viewer.tenant_id:
        raise Unauthorized("this API key no longer exists", code="invalid_session")
    if key.revoked_at is not None or tenant.disabled or _expired(key.expires_at):
        raise Unauthorized("this API key can no longer sign in", code="invalid_session")
    return viewer


def _expired(expires_at: datetime | None) -> bool:
    if expires_at is None:
        return False
    aware = expires_at if expires_at.tzinfo is not None else expires_at.replace(tzinfo=UTC)
    return aware <= datetime.now(UTC)


async def sign_out(src: DashboardSources, token: str | None) -> bool:
    """End the session of `token` for every copy of it: its id is recorded until it would have
    expired. False when the quota Redis did not take it (the session then lasts until its
    expiry); True also for a token that is no session (nothing to end)."""
    try:
        viewer = decode(src, token)
    except Unauthorized:
        return True
    try:
        async with asyncio.timeout(src.redis_timeout):
            await src.redis.set(SIGNED_OUT + viewer.session_id, 1, exat=viewer.expires_at)
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning(
            "dashboard: a sign-out was not recorded, the quota Redis did not answer: %r", exc
        )
        return False
    return True


async def _signed_out(src: DashboardSources, viewer: Viewer) -> bool:
    """Whether the viewer's session was signed out; False when the quota Redis does not answer
    (the dashboard stays usable without it, see the module's docstring)."""
    try:
        async with asyncio.timeout(src.redis_timeout):
            return bool(await src.redis.exists(SIGNED_OUT + viewer.session_id))
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("dashboard: sign-outs not checked, the quota Redis did not answer: %r", exc)
        return False
